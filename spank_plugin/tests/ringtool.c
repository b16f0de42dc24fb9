/*
 * ringtool.c - write and read rings from C, for the Python tests that check
 * the Python reader/writer against this implementation of sg_ring.h.
 *
 *   sg_ringtool layout                  JSON: sizes, offsets, constants
 *   sg_ringtool write PATH N CAP [US]   create PATH, append N records whose
 *                                       fields derive from their index i
 *                                       (see fill()); US: pause between
 *                                       records in microseconds
 *   sg_ringtool read PATH               one line per readable record:
 *                                       n op comm_id count bytes start end
 *                                       peer datatype redop flags status
 *                                       gpu_start gpu_end coll_seq
 *   sg_ringtool hold PATH               print control, holds, hold_timeouts
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../sg_ring.h"
#include "../sg_ring_file.h"

static void fill(struct sg_record *r, uint64_t i)
{
	memset(r, 0, sizeof(*r));
	r->comm_id = 0x1000 + i % 3;
	r->count = i;
	r->bytes = i * 4;
	r->start_ns = 1000000000ull + i * 1000;
	r->end_ns = 1000000000ull + i * 1000 + 500;
	r->peer = (int32_t)(i % 5) - 1;
	r->op = (uint16_t)(1 + i % 8);
	r->datatype = SG_DT_FLOAT32;
	r->redop = SG_REDOP_SUM;
	r->flags = (uint32_t)(i % 2 ? SG_F_IN_GROUP : 0);
	r->status = 0;
	/* every third record carries GPU times and transfer fields, to check
	 * the second half of the layout */
	if (i % 3 == 0) {
		r->flags |= SG_F_GPU_TIME;
		r->gpu_start_ns = r->start_ns + 200;
		r->gpu_end_ns = r->end_ns + 20000 + i;
		r->coll_seq = i + 1;
		r->xfer_net_ns = i * 7;
		r->xfer_peer_wait_ns = i * 5;
		r->xfer_gpu_wait_ns = i * 3;
		r->xfer_channels = 1ull << (i % 64);
		r->xfer_ops = (uint32_t)i;
	}
}

#define OFF(T, f) printf("  \"%s.%s\": %zu,\n", #T, #f, offsetof(struct T, f))

static int layout(void)
{
	printf("{\n");
	printf("  \"header_size\": %zu,\n  \"record_size\": %zu,\n",
	       sizeof(struct sg_ring_header), sizeof(struct sg_record));
	OFF(sg_ring_header, magic);
	OFF(sg_ring_header, version);
	OFF(sg_ring_header, header_size);
	OFF(sg_ring_header, record_size);
	OFF(sg_ring_header, capacity);
	OFF(sg_ring_header, job_id);
	OFF(sg_ring_header, step_id);
	OFF(sg_ring_header, global_rank);
	OFF(sg_ring_header, local_rank);
	OFF(sg_ring_header, world_size);
	OFF(sg_ring_header, pid);
	OFF(sg_ring_header, clock_offset_ns);
	OFF(sg_ring_header, created_ns);
	OFF(sg_ring_header, source);
	OFF(sg_ring_header, header_flags);
	OFF(sg_ring_header, node_name);
	OFF(sg_ring_header, write_counter);
	OFF(sg_ring_header, overwritten);
	OFF(sg_ring_header, control);
	OFF(sg_ring_header, hold_timeout_ms);
	OFF(sg_ring_header, hold_since_ns);
	OFF(sg_ring_header, holds);
	OFF(sg_ring_header, hold_timeouts);
	OFF(sg_record, seq);
	OFF(sg_record, comm_id);
	OFF(sg_record, count);
	OFF(sg_record, bytes);
	OFF(sg_record, start_ns);
	OFF(sg_record, end_ns);
	OFF(sg_record, peer);
	OFF(sg_record, op);
	OFF(sg_record, datatype);
	OFF(sg_record, redop);
	OFF(sg_record, flags);
	OFF(sg_record, status);
	OFF(sg_record, gpu_start_ns);
	OFF(sg_record, gpu_end_ns);
	OFF(sg_record, coll_seq);
	OFF(sg_record, xfer_net_ns);
	OFF(sg_record, xfer_peer_wait_ns);
	OFF(sg_record, xfer_gpu_wait_ns);
	OFF(sg_record, xfer_channels);
	OFF(sg_record, xfer_ops);
	OFF(sg_record, reserved);
	OFF(sg_ring_header, gpu_lost);
	OFF(sg_ring_header, gpu_state);
	OFF(sg_ring_header, gpu_error);
	OFF(sg_ring_header, in_flight);
	OFF(sg_ring_header, in_flight_since_ns);
	printf("  \"magic\": %llu,\n  \"version\": %u,\n", (unsigned long long)SG_RING_MAGIC,
	       SG_RING_VERSION);
	printf("  \"node_name_len\": %d\n}\n", SG_NODE_NAME_LEN);
	return 0;
}

int main(int argc, char **argv)
{
	struct sg_ring_header *h;
	struct sg_record r;
	const char *why;
	uint64_t i, n;

	if (argc >= 2 && strcmp(argv[1], "layout") == 0)
		return layout();
	if (argc >= 5 && strcmp(argv[1], "write") == 0) {
		struct sg_ring_meta m = { .capacity = (uint32_t)strtoul(argv[4], NULL, 10),
					  .job_id = 31337, .step_id = SG_STEP_BATCH,
					  .global_rank = 5, .local_rank = 1, .world_size = 16,
					  .source = SG_SOURCE_TEST, .node_name = "node-c" };
		unsigned pause = argc >= 6 ? (unsigned)strtoul(argv[5], NULL, 10) : 0;

		n = strtoull(argv[3], NULL, 10);
		h = sg_ring_create(argv[2], &m);
		if (!h) {
			perror(argv[2]);
			return 1;
		}
		/* tell a waiting reader we are running */
		printf("ready\n");
		fflush(stdout);
		for (i = 0; i < n; i++) {
			fill(&r, i);
			sg_ring_append(h, &r);
			if (pause)
				usleep(pause);
		}
		sg_ring_unmap(h);
		return 0;
	}
	if (argc >= 3 && strcmp(argv[1], "read") == 0) {
		h = sg_ring_open(argv[2], &why);
		if (!h) {
			fprintf(stderr, "%s: %s\n", argv[2], why);
			return 1;
		}
		n = atomic_load(&h->write_counter);
		for (i = n > h->capacity ? n - h->capacity : 0; i < n; i++) {
			if (sg_ring_read(h, i, &r) != SG_READ_OK)
				continue;
			printf("%llu %u %llu %llu %llu %llu %llu %d %u %u %u %d %llu %llu %llu\n",
			       (unsigned long long)i, r.op, (unsigned long long)r.comm_id,
			       (unsigned long long)r.count, (unsigned long long)r.bytes,
			       (unsigned long long)r.start_ns, (unsigned long long)r.end_ns, r.peer,
			       r.datatype, r.redop, r.flags, r.status,
			       (unsigned long long)r.gpu_start_ns, (unsigned long long)r.gpu_end_ns,
			       (unsigned long long)r.coll_seq);
		}
		sg_ring_unmap(h);
		return 0;
	}
	if (argc >= 3 && strcmp(argv[1], "hold") == 0) {
		h = sg_ring_open(argv[2], &why);
		if (!h) {
			fprintf(stderr, "%s: %s\n", argv[2], why);
			return 1;
		}
		printf("%u %u %llu %llu\n", atomic_load(&h->control), h->hold_timeout_ms,
		       (unsigned long long)atomic_load(&h->holds),
		       (unsigned long long)atomic_load(&h->hold_timeouts));
		sg_ring_unmap(h);
		return 0;
	}
	fprintf(stderr, "usage: sg_ringtool layout | write PATH N CAP [US] | read PATH | hold PATH\n");
	return 2;
}
