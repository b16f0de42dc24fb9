/*
 * test_ring.c - the ring's commit protocol under concurrency, overflow
 * accounting, and rejection of damaged files.
 *
 * Four writer threads hammer a 64-slot ring with self-checking records
 * (every field is a function of one key) while a reader thread reads
 * behind them; no record the reader accepts may be torn.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../sg_ring.h"
#include "../sg_ring_file.h"
#include "check.h"

#define WRITERS 4
#define PER_WRITER 200000

static struct sg_ring_header *ring;
static _Atomic int writers_done;
static _Atomic int reader_running;

static void fill(struct sg_record *r, uint64_t key)
{
	memset(r, 0, sizeof(*r));
	r->comm_id = key ^ 0xabcdef;
	r->count = key;
	r->bytes = key * 8 + 1;
	r->start_ns = key * 3;
	r->end_ns = key * 3 + 7;
	r->peer = (int32_t)(key % 1000);
	r->op = (uint16_t)(1 + key % 8);
	r->datatype = (uint8_t)(key % 17);
	r->redop = (uint8_t)(key % 7);
	r->flags = (uint32_t)(key & 0x3f);
	r->status = (int32_t)(key % 5);
}

static int consistent(const struct sg_record *r)
{
	struct sg_record want;

	fill(&want, r->count);
	return r->comm_id == want.comm_id && r->bytes == want.bytes &&
	       r->start_ns == want.start_ns && r->end_ns == want.end_ns && r->peer == want.peer &&
	       r->op == want.op && r->datatype == want.datatype && r->redop == want.redop &&
	       r->flags == want.flags && r->status == want.status;
}

static void *writer(void *arg)
{
	uint64_t base = (uint64_t)(uintptr_t)arg * PER_WRITER;
	struct sg_record r;
	uint64_t i;

	while (!atomic_load(&reader_running))
		sched_yield();
	for (i = 0; i < PER_WRITER; i++) {
		fill(&r, base + i);
		sg_ring_append(ring, &r);
		/* on a loaded machine, let the reader in now and then */
		if (i % 4096 == 0)
			sched_yield();
	}
	atomic_fetch_add(&writers_done, 1);
	return NULL;
}

struct reader_stats {
	uint64_t ok, torn, lost, bad;
};

static void *reader(void *arg)
{
	struct reader_stats *st = arg;
	struct sg_record r;
	uint64_t cursor = 0;
	int last = 0;

	atomic_store(&reader_running, 1);
	while (!last) {
		last = atomic_load(&writers_done) == WRITERS;
		uint64_t wc = atomic_load(&ring->write_counter);

		if (wc > cursor + ring->capacity) {
			st->lost += wc - ring->capacity - cursor;
			cursor = wc - ring->capacity;
		}
		while (cursor < wc) {
			enum sg_read_result res = sg_ring_read(ring, cursor, &r);

			if (res == SG_READ_NOT_YET)
				break;
			if (res == SG_READ_OK) {
				st->ok++;
				if (!consistent(&r))
					st->bad++;
			} else if (res == SG_READ_TORN) {
				st->torn++;
			} else {
				st->lost++;
			}
			cursor++;
		}
	}
	return NULL;
}

static void write_file(const char *path, const void *data, size_t len)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

	if (fd >= 0) {
		if (write(fd, data, len) != (ssize_t)len)
			perror("write");
		close(fd);
	}
}

int main(void)
{
	char dir[] = "/tmp/sg-test-ring-XXXXXX";
	char path[4096], bad[4096];
	struct sg_ring_meta m = { .capacity = 50, .job_id = 1, .step_id = 0, .global_rank = 0,
				  .local_rank = 0, .world_size = 1, .source = SG_SOURCE_TEST,
				  .node_name = "n" };
	struct reader_stats st = { 0 };
	pthread_t w[WRITERS], rd;
	struct sg_record r;
	const char *why;
	uint64_t total = (uint64_t)WRITERS * PER_WRITER, i, seen;
	int k;

	if (!mkdtemp(dir))
		return 2;
	snprintf(path, sizeof(path), "%s/ring", dir);
	ring = sg_ring_create(path, &m);
	CHECK(ring != NULL, "create");
	if (!ring)
		DONE("test_ring");
	CHECK(ring->capacity == 64, "capacity rounded to %u", ring->capacity);
	CHECK(sg_ring_create(path, &m) == NULL, "create must not reuse an existing file");

	pthread_create(&rd, NULL, reader, &st);
	for (k = 0; k < WRITERS; k++)
		pthread_create(&w[k], NULL, writer, (void *)(uintptr_t)k);
	for (k = 0; k < WRITERS; k++)
		pthread_join(w[k], NULL);
	pthread_join(rd, NULL);

	CHECK(st.bad == 0, "%llu torn records accepted", (unsigned long long)st.bad);
	CHECK(st.ok > 0, "reader saw nothing");
	printf("test_ring: reader accepted %llu, rejected torn %llu, lost %llu\n",
	       (unsigned long long)st.ok, (unsigned long long)st.torn, (unsigned long long)st.lost);
	CHECK(atomic_load(&ring->write_counter) == total, "write_counter");
	CHECK(atomic_load(&ring->overwritten) == total - 64, "overwritten %llu",
	      (unsigned long long)atomic_load(&ring->overwritten));
	/* at rest, the last capacity records are all there and distinct */
	seen = 0;
	for (i = total - 64; i < total; i++) {
		if (sg_ring_read(ring, i, &r) == SG_READ_OK && consistent(&r) &&
		    atomic_load(&r.seq) == i + 1)
			seen++;
	}
	CHECK(seen == 64, "only %llu of the last 64 records readable", (unsigned long long)seen);
	CHECK(sg_ring_read(ring, total - 65, &r) == SG_READ_OVERWRITTEN, "older record lost");

	/* damaged files are refused with a reason, never mapped blindly */
	snprintf(bad, sizeof(bad), "%s/short", dir);
	write_file(bad, ring, 100);
	CHECK(sg_ring_open(bad, &why) == NULL && why && strstr(why, "truncated"), "short: %s",
	      why ? why : "accepted");
	unlink(bad);
	snprintf(bad, sizeof(bad), "%s/cut", dir);
	write_file(bad, ring, SG_RING_HEADER_SIZE + 10 * SG_RING_RECORD_SIZE);
	CHECK(sg_ring_open(bad, &why) == NULL && why && strstr(why, "truncated"), "cut: %s",
	      why ? why : "accepted");
	unlink(bad);
	{
		static struct sg_ring_header copy;

		memcpy(&copy, ring, sizeof(copy));
		copy.magic = 0x1234;
		snprintf(bad, sizeof(bad), "%s/magic", dir);
		write_file(bad, &copy, sizeof(copy));
		CHECK(sg_ring_open(bad, &why) == NULL && why && strstr(why, "magic"), "magic: %s",
		      why ? why : "accepted");
		unlink(bad);
		memcpy(&copy, ring, sizeof(copy));
		copy.capacity = 100;
		snprintf(bad, sizeof(bad), "%s/cap", dir);
		write_file(bad, &copy, sizeof(copy));
		CHECK(sg_ring_open(bad, &why) == NULL && why && strstr(why, "capacity"), "cap: %s",
		      why ? why : "accepted");
		unlink(bad);
	}
	{
		struct sg_ring_header *again = sg_ring_open(path, &why);

		CHECK(again != NULL && again->capacity == 64 && again->source == SG_SOURCE_TEST,
		      "reopen: %s", why ? why : "");
		sg_ring_unmap(again);
	}
	sg_ring_unmap(ring);
	unlink(path);
	rmdir(dir);
	DONE("test_ring");
}
