/*
 * test_hook.c - the NCCL hook against the fake libnccl.
 *
 * Run with LD_PRELOAD=libslurmguard_nccl.so; linked against the fake
 * libnccl.so.2. Checks that results and return codes are those of the fake
 * library alone, that each call was forwarded exactly once, and that the
 * ring holds one record per call with the right op, counts, sizes,
 * communicator ids, ranks, flags and plausible timestamps; then overflow
 * accounting and the hold control word (release and timeout).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>

#include "testlib.h"


#define NOEV SG_F_NO_EVENT
#define RANK 3
#define WORLD 8

static uint64_t fnv_unique_id(const ncclUniqueId *id)
{
	uint64_t h = 0xcbf29ce484222325ull;
	size_t i;

	for (i = 0; i < sizeof(id->internal); i++) {
		h ^= (unsigned char)id->internal[i];
		h *= 0x100000001b3ull;
	}
	return h ? h : 1;
}

struct expect {
	uint16_t op;
	int32_t peer;
	uint64_t count;
	uint8_t datatype;
	uint8_t redop;
	uint32_t flags;
	int32_t status;
	int comm; /* index into comm_ids, -1 for none */
};

static uint64_t comm_ids[3];

static void check_record(const struct sg_record *r, const struct expect *e, uint64_t n)
{
	CHECK(r->op == e->op, "record %llu: op %u, want %u", (unsigned long long)n, r->op, e->op);
	CHECK(r->peer == e->peer, "record %llu (op %u): peer %d, want %d", (unsigned long long)n,
	      r->op, r->peer, e->peer);
	CHECK(r->count == e->count, "record %llu (op %u): count %llu, want %llu",
	      (unsigned long long)n, r->op, (unsigned long long)r->count,
	      (unsigned long long)e->count);
	CHECK(r->datatype == e->datatype, "record %llu (op %u): datatype %u, want %u",
	      (unsigned long long)n, r->op, r->datatype, e->datatype);
	CHECK(r->bytes == e->count * sg_datatype_size(e->datatype) || e->op == SG_OP_COMM_INIT,
	      "record %llu (op %u): bytes %llu", (unsigned long long)n, r->op,
	      (unsigned long long)r->bytes);
	CHECK(r->redop == e->redop, "record %llu (op %u): redop %u, want %u", (unsigned long long)n,
	      r->op, r->redop, e->redop);
	CHECK(r->flags == e->flags, "record %llu (op %u): flags %#x, want %#x",
	      (unsigned long long)n, r->op, r->flags, e->flags);
	CHECK(r->status == e->status, "record %llu (op %u): status %d, want %d",
	      (unsigned long long)n, r->op, r->status, e->status);
	if (e->comm >= 0)
		CHECK(r->comm_id == comm_ids[e->comm], "record %llu (op %u): comm_id %#llx, want %#llx",
		      (unsigned long long)n, r->op, (unsigned long long)r->comm_id,
		      (unsigned long long)comm_ids[e->comm]);
	else
		CHECK(r->comm_id == 0, "record %llu: comm_id %#llx, want 0", (unsigned long long)n,
		      (unsigned long long)r->comm_id);
}

struct release_arg {
	struct sg_ring_header *h;
	unsigned delay_ms;
};

static void *release_later(void *p)
{
	struct release_arg *a = p;
	struct timespec ts = { a->delay_ms / 1000, (long)(a->delay_ms % 1000) * 1000000L };

	nanosleep(&ts, NULL);
	atomic_fetch_and(&a->h->control, ~SG_CTL_HOLD);
	return NULL;
}

#define MT_CALLS 60

struct mt_arg {
	ncclComm_t comm;
	int id;
};

static void *mt_worker(void *p)
{
	struct mt_arg *a = p;
	static float in[4][5000], out[4][5000];
	int i;

	for (i = 0; i < MT_CALLS; i++)
		ncclAllReduce(in[a->id], out[a->id], (size_t)(1000 * (a->id + 1) + i), ncclFloat32,
			      ncclMax, a->comm, NULL);
	return NULL;
}

int main(void)
{
	char dir[] = "/tmp/sg-test-hook-XXXXXX";
	float fsend[64], frecv[64 * WORLD];
	int32_t isend[16], irecv[16 * WORLD];
	double dsend[100];
	int8_t brecv[50];
	ncclUniqueId uid, uid2;
	ncclComm_t comm, comm_twin, comm_split;
	struct sg_ring_header *h;
	struct sg_record r;
	uint64_t t_begin, t_end, n, wc, prev_start = 0;
	unsigned long long elems;
	ncclResult_t rc;
	int i, ok;

	test_dir_make(dir);
	setenv("SLURMGUARD_JOB_ID", "4242", 1);
	setenv("SLURMGUARD_STEP_ID", "7", 1);
	setenv("SLURMGUARD_RING_RECORDS", "1000", 1); /* rounded up to 1024 */
	setenv("RANK", "3", 1);
	setenv("WORLD_SIZE", "8", 1);
	setenv("LOCAL_RANK", "1", 1);
	setenv("SLURMD_NODENAME", "nodeX", 1);

	for (i = 0; i < 64; i++)
		fsend[i] = (float)i * 0.5f;
	for (i = 0; i < 16; i++)
		isend[i] = i - 5;
	for (i = 0; i < 100; i++)
		dsend[i] = i;

	t_begin = sg_mono_ns();
	CHECK(ncclGetUniqueId(&uid) == ncclSuccess, "getuniqueid");
	CHECK(ncclGetUniqueId(&uid2) == ncclSuccess, "getuniqueid");
	comm_ids[0] = fnv_unique_id(&uid);
	comm_ids[1] = fnv_unique_id(&uid2);

	/* 0 */ rc = ncclCommInitRank(&comm, WORLD, uid, RANK);
	CHECK(rc == ncclSuccess, "init rc %d", rc);
	/* 1: a second communicator from the same unique id (as another rank
	 * would build it) must get the same comm id */
	rc = ncclCommInitRankConfig(&comm_twin, WORLD, uid, 5, NULL);
	CHECK(rc == ncclSuccess, "init config rc %d", rc);
	/* 2 */ rc = ncclAllReduce(fsend, frecv, 64, ncclFloat32, ncclSum, comm, NULL);
	CHECK(rc == ncclSuccess, "allreduce rc %d", rc);
	for (ok = 1, i = 0; i < 64; i++)
		ok &= frecv[i] == fsend[i] * WORLD;
	CHECK(ok, "allreduce result changed");
	/* 3 */ rc = ncclAllGather(isend, irecv, 16, ncclInt32, comm, NULL);
	CHECK(rc == ncclSuccess, "allgather rc %d", rc);
	for (ok = 1, i = 0; i < 16 * WORLD; i++)
		ok &= irecv[i] == isend[i % 16];
	CHECK(ok, "allgather result changed");
	/* 4 */ rc = ncclReduceScatter(fsend, frecv, 8, ncclFloat32, ncclMax, comm, NULL);
	CHECK(rc == ncclSuccess, "reducescatter rc %d", rc);
	for (ok = 1, i = 0; i < 8; i++)
		ok &= frecv[i] == fsend[RANK * 8 + i];
	CHECK(ok, "reducescatter result changed");
	/* 5 */ rc = ncclBroadcast(fsend, frecv, 10, ncclFloat32, 2, comm, NULL);
	CHECK(rc == ncclSuccess, "broadcast rc %d", rc);
	/* 6: ncclBcast calls ncclBroadcast inside the library: one record */
	rc = ncclBcast(frecv, 12, ncclFloat32, 1, comm, NULL);
	CHECK(rc == ncclSuccess, "bcast rc %d", rc);
	/* 7: reduce at another root leaves recvbuff alone */
	frecv[0] = -1.0f;
	rc = ncclReduce(fsend, frecv, 5, ncclFloat32, ncclAvg, 0, comm, NULL);
	CHECK(rc == ncclSuccess && frecv[0] == -1.0f, "reduce rc %d / result changed", rc);
	/* 8..11 */
	CHECK(ncclGroupStart() == ncclSuccess, "groupstart");
	CHECK(ncclSend(dsend, 100, ncclFloat64, 2, comm, NULL) == ncclSuccess, "send");
	rc = ncclRecv(brecv, 50, ncclInt8, 4, comm, NULL);
	CHECK(rc == ncclSuccess && brecv[49] == 5, "recv rc %d value %d", rc, brecv[49]);
	CHECK(ncclGroupEnd() == ncclSuccess, "groupend");
	/* 12 */ rc = ncclAllToAll(isend, irecv, 2, ncclInt32, comm, NULL);
	CHECK(rc == ncclSuccess && irecv[0] == isend[2 * RANK], "alltoall rc %d", rc);
	/* 13: an error from NCCL passes through unchanged */
	rc = ncclAllReduce(fsend, frecv, 4, (ncclDataType_t)99, ncclSum, comm, NULL);
	CHECK(rc == ncclInvalidArgument, "bad datatype rc %d, want %d", rc, ncclInvalidArgument);
	/* 14 */ rc = ncclCommSplit(comm, 7, 0, &comm_split, NULL);
	CHECK(rc == ncclSuccess && comm_split, "split rc %d", rc);
	/* 15 */ rc = ncclAllReduce(isend, irecv, 16, ncclInt32, ncclSum, comm_split, NULL);
	CHECK(rc == ncclSuccess && irecv[15] == isend[15] * WORLD, "split allreduce rc %d", rc);
	/* 16 */ CHECK(ncclCommDestroy(comm_split) == ncclSuccess, "destroy");
	t_end = sg_mono_ns();

	/* every call reached the library exactly once */
	CHECK(fakeNcclCalls("ncclAllReduce", &elems) == 3 && elems == 64 + 4 + 16,
	      "allreduce forwarded %llu times", fakeNcclCalls("ncclAllReduce", NULL));
	CHECK(fakeNcclCalls("ncclBroadcast", NULL) == 2, "broadcast forwarded %llu times",
	      fakeNcclCalls("ncclBroadcast", NULL));
	CHECK(fakeNcclCalls("ncclBcast", NULL) == 1, "bcast forwarded");
	CHECK(fakeNcclCalls("ncclSend", &elems) == 1 && elems == 100, "send forwarded");
	CHECK(fakeNcclCalls("ncclGroupEnd", NULL) == 1, "groupend forwarded");

	h = test_ring(dir, 3, "7", "nccl", 1);
	if (!h)
		DONE("test_hook");
	CHECK(h->capacity == 1024, "capacity %u", h->capacity);
	CHECK(h->job_id == 4242 && h->step_id == 7, "job %u step %u", h->job_id, h->step_id);
	CHECK(h->global_rank == RANK && h->world_size == WORLD && h->local_rank == 1,
	      "rank %d/%d local %d", h->global_rank, h->world_size, h->local_rank);
	CHECK(h->source == SG_SOURCE_NCCL && h->pid == (uint32_t)getpid(), "source/pid");
	CHECK(strcmp(h->node_name, "nodeX") == 0, "node %s", h->node_name);
	{
		struct timespec rt;
		int64_t wall;

		clock_gettime(CLOCK_REALTIME, &rt);
		wall = (int64_t)rt.tv_sec * 1000000000ll + rt.tv_nsec;
		CHECK(llabs(wall - (int64_t)sg_mono_ns() - h->clock_offset_ns) < 50000000ll,
		      "clock offset %lld", (long long)h->clock_offset_ns);
	}

	/* no CUDA runtime in this process: host times, every call that wanted
	 * GPU time says it has none, the header says why */
	CHECK(atomic_load(&h->gpu_state) == SG_GPU_NO_RUNTIME, "gpu_state %u",
	      atomic_load(&h->gpu_state));
	{
		/* the split communicator: id derived from parent and color */
		const struct expect want[] = {
			{ SG_OP_COMM_INIT, RANK, WORLD, 0, 0, 0, 0, 0 },
			{ SG_OP_COMM_INIT, 5, WORLD, 0, 0, 0, 0, 0 },
			{ SG_OP_ALLREDUCE, -1, 64, SG_DT_FLOAT32, SG_REDOP_SUM, NOEV, 0, 0 },
			{ SG_OP_ALLGATHER, -1, 16, SG_DT_INT32, 0, NOEV, 0, 0 },
			{ SG_OP_REDUCESCATTER, -1, 8, SG_DT_FLOAT32, SG_REDOP_MAX, NOEV, 0, 0 },
			{ SG_OP_BROADCAST, 2, 10, SG_DT_FLOAT32, 0, NOEV, 0, 0 },
			{ SG_OP_BROADCAST, 1, 12, SG_DT_FLOAT32, 0, NOEV, 0, 0 },
			{ SG_OP_REDUCE, 0, 5, SG_DT_FLOAT32, SG_REDOP_AVG, NOEV, 0, 0 },
			{ SG_OP_GROUP_START, -1, 0, 0, 0, 0, 0, -1 },
			{ SG_OP_SEND, 2, 100, SG_DT_FLOAT64, 0, SG_F_IN_GROUP, 0, 0 },
			{ SG_OP_RECV, 4, 50, SG_DT_INT8, 0, SG_F_IN_GROUP, 0, 0 },
			{ SG_OP_GROUP_END, -1, 0, 0, 0, NOEV, 0, -1 },
			{ SG_OP_ALLTOALL, -1, 2, SG_DT_INT32, 0, NOEV, 0, 0 },
			{ SG_OP_ALLREDUCE, -1, 4, SG_DT_UNKNOWN, SG_REDOP_SUM, SG_F_ERROR | NOEV,
			  ncclInvalidArgument, 0 },
			{ SG_OP_COMM_SPLIT, RANK, WORLD, 0, 0, 0, 0, 2 },
			{ SG_OP_ALLREDUCE, -1, 16, SG_DT_INT32, SG_REDOP_SUM, NOEV, 0, 2 },
			{ SG_OP_COMM_DESTROY, RANK, WORLD, 0, 0, 0, 0, 2 },
		};
		const size_t nwant = sizeof(want) / sizeof(want[0]);

		wc = committed(h);
		CHECK(wc == nwant, "records %llu, want %zu", (unsigned long long)wc, nwant);
		CHECK(atomic_load(&h->write_counter) == 64, "one block of 64 reserved, not %llu",
		      (unsigned long long)atomic_load(&h->write_counter));
		/* the split id is whatever the comm_split record says; it must
		 * then be used by the records of that communicator */
		if (wc > 14 && sg_ring_read(h, 14, &r) == SG_READ_OK) {
			comm_ids[2] = r.comm_id;
			CHECK(r.comm_id != 0 && r.comm_id != comm_ids[0], "split id %#llx",
			      (unsigned long long)r.comm_id);
		}
		for (n = 0; n < wc && n < nwant; n++) {
			CHECK(sg_ring_read(h, n, &r) == SG_READ_OK, "read %llu", (unsigned long long)n);
			check_record(&r, &want[n], n);
			CHECK(atomic_load(&r.seq) == n + 1, "seq");
			CHECK(r.start_ns >= t_begin && r.end_ns <= t_end && r.start_ns <= r.end_ns,
			      "record %llu times %llu..%llu outside %llu..%llu", (unsigned long long)n,
			      (unsigned long long)r.start_ns, (unsigned long long)r.end_ns,
			      (unsigned long long)t_begin, (unsigned long long)t_end);
			CHECK(r.start_ns >= prev_start, "record %llu starts before its predecessor",
			      (unsigned long long)n);
			prev_start = r.start_ns;
		}
	}

	/* overflow: the oldest records are overwritten and the loss counted */
	for (i = 0; i < 3000; i++)
		ncclAllReduce(fsend, frecv, 1, ncclFloat32, ncclSum, comm, NULL);
	wc = committed(h);
	CHECK(wc == 17 + 3000, "records after overflow %llu", (unsigned long long)wc);
	CHECK(atomic_load(&h->write_counter) == 3072, "reserved %llu",
	      (unsigned long long)atomic_load(&h->write_counter));
	CHECK(atomic_load(&h->overwritten) == wc - 1024, "overwritten %llu",
	      (unsigned long long)atomic_load(&h->overwritten));
	CHECK(sg_ring_read(h, 0, &r) == SG_READ_OVERWRITTEN, "record 0 not reported lost");
	CHECK(sg_ring_read(h, wc - 1, &r) == SG_READ_OK && r.op == SG_OP_ALLREDUCE && r.count == 1,
	      "newest record");
	CHECK(sg_ring_read(h, wc, &r) == SG_READ_NOT_YET, "record past the end");

	/* hold, released by the controller after 150 ms */
	{
		struct release_arg a = { h, 150 };
		pthread_t th;
		uint64_t t0, dt;

		atomic_fetch_or(&h->control, SG_CTL_HOLD);
		/* the clock starts before the releaser's 150 ms do: a releaser
		 * scheduled before this thread reads the clock must not shorten dt */
		t0 = sg_mono_ns();
		pthread_create(&th, NULL, release_later, &a);
		rc = ncclAllReduce(fsend, frecv, 3, ncclFloat32, ncclSum, comm, NULL);
		dt = sg_mono_ns() - t0;
		pthread_join(th, NULL);
		CHECK(rc == ncclSuccess, "held allreduce rc %d", rc);
		CHECK(dt >= 140000000ull && dt < 5000000000ull, "hold lasted %llu ns",
		      (unsigned long long)dt);
		CHECK(atomic_load(&h->holds) == 1 && atomic_load(&h->hold_timeouts) == 0, "holds");
		CHECK(atomic_load(&h->hold_since_ns) == 0, "hold_since not cleared");
		wc = committed(h);
		CHECK(sg_ring_read(h, wc - 2, &r) == SG_READ_OK && r.op == SG_OP_HOLD &&
			      r.end_ns - r.start_ns >= 140000000ull && !(r.flags & SG_F_TIMEOUT),
		      "hold record op %u", r.op);
		CHECK(sg_ring_read(h, wc - 1, &r) == SG_READ_OK && r.op == SG_OP_ALLREDUCE &&
			      r.count == 3 && r.end_ns - r.start_ns < 140000000ull,
		      "held call's record must not include the hold");
	}
	/* hold with nobody to release it: the timeout lets the rank go on */
	{
		uint64_t t0, dt;

		h->hold_timeout_ms = 100;
		atomic_fetch_or(&h->control, SG_CTL_HOLD);
		t0 = sg_mono_ns();
		rc = ncclSend(dsend, 1, ncclFloat64, 0, comm, NULL);
		dt = sg_mono_ns() - t0;
		CHECK(rc == ncclSuccess, "send after timeout rc %d", rc);
		CHECK(dt >= 100000000ull && dt < 3000000000ull, "timeout hold lasted %llu ns",
		      (unsigned long long)dt);
		CHECK((atomic_load(&h->control) & SG_CTL_HOLD) == 0, "hold bit not cleared");
		CHECK(atomic_load(&h->hold_timeouts) == 1 && atomic_load(&h->holds) == 2,
		      "timeouts %llu", (unsigned long long)atomic_load(&h->hold_timeouts));
		wc = committed(h);
		CHECK(sg_ring_read(h, wc - 2, &r) == SG_READ_OK && r.op == SG_OP_HOLD &&
			      (r.flags & SG_F_TIMEOUT),
		      "timeout hold record");
	}
	/* several threads issuing at once: every call recorded exactly once,
	 * no hole left once the first thread calls again */
	{
		pthread_t th[4];
		struct mt_arg args[4];
		uint64_t n0 = committed(h), n, seen[4] = { 0 }, pads = 0, other = 0;
		int k;

		for (k = 0; k < 4; k++) {
			args[k].comm = comm;
			args[k].id = k;
			pthread_create(&th[k], NULL, mt_worker, &args[k]);
		}
		for (k = 0; k < 4; k++)
			pthread_join(th[k], NULL);
		ncclAllReduce(fsend, frecv, 2, ncclFloat32, ncclSum, comm, NULL);
		wc = atomic_load(&h->write_counter);
		for (n = n0; n < wc; n++) {
			enum sg_read_result res = sg_ring_read(h, n, &r);

			if (res == SG_READ_NOT_YET)
				break;
			CHECK(res == SG_READ_OK, "record %llu: %d", (unsigned long long)n, res);
			if (r.op == SG_OP_NONE)
				pads++;
			else if (r.op == SG_OP_ALLREDUCE && r.count >= 1000)
				seen[r.count / 1000 - 1] |= 1ull << (r.count % 1000);
			else
				other++;
		}
		for (k = 0; k < 4; k++)
			CHECK(seen[k] == (1ull << MT_CALLS) - 1, "thread %d: records %#llx", k,
			      (unsigned long long)seen[k]);
		CHECK(other == 1, "records besides the threads' and the padding: %llu",
		      (unsigned long long)other);
		CHECK(n == wc, "a hole at record %llu of %llu", (unsigned long long)n,
		      (unsigned long long)wc);
		printf("test_hook: 4 threads: %d records each, %llu padding records\n", MT_CALLS,
		       (unsigned long long)pads);
	}
	CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroy");
	CHECK(ncclCommDestroy(comm_twin) == ncclSuccess, "destroy twin");

	sg_ring_unmap(h);
	test_dir_remove(dir);
	DONE("test_hook");
}
