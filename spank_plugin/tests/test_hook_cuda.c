/*
 * test_hook_cuda.c - the hook's CUDA-event timing against the fake CUDA
 * runtime (fake_cudart.c) and the fake libnccl, whose calls enqueue
 * kernels on streams and return (no GPU here: both are fakes, see their
 * headers for what they model).
 *
 * Run with LD_PRELOAD=libslurmguard_nccl.so. Each scenario runs in its own
 * forked process (own ring directory, own stderr file), as each turns
 * timing on or off for its whole process:
 *   timing    a collective that enqueues in 5 us and runs 20 ms on the
 *             stream is recorded as 20 ms; default stream; a group timed as
 *             a whole; graph capture left intact while events are polled;
 *             several threads; a communicator destroyed with events in
 *             flight; no CUDA call before the first collective
 *   slowpeer  two ranks (processes) in one clique, rank 1 late by 80 ms:
 *             rank 0's record shows the wait, rank 1's the late start
 *   pool      an exhausted event pool turns timing off, one stderr line,
 *             results and return codes untouched
 *   disabled  SLURMGUARD_CUDA_EVENTS=0: host times, no CUDA event made
 *   cudaerr   a CUDA error turns timing off, in-flight records keep host
 *             times and are counted lost
 *   exit      exit with a collective still running: exit is not delayed,
 *             the exit status is the job's, done records are flushed and
 *             the rest counted lost
 *   killed    SIGKILL mid-collective: the finished records are intact, the
 *             one in flight stays an uncommitted hole that readers give up
 *             on (sg_ring.h), nothing after it is damaged
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>

#include "testlib.h"




static char g_dir[256];
static float fin[8] = { 1, 2, 3, 4, 5, 6, 7, 8 }, fout[8];

static struct sg_ring_header *open_ring(int rank)
{
	return test_ring(g_dir, rank, "0", "nccl", 1);
}

/* Wait up to timeout for record n to be committed; 1 if it is. */
static int wait_record(struct sg_ring_header *h, uint64_t n, struct sg_record *r, uint64_t timeout)
{
	uint64_t until = sg_mono_ns() + timeout;

	do {
		if (sg_ring_read(h, n, r) == SG_READ_OK)
			return 1;
		sleep_ns(200 * US);
	} while (sg_mono_ns() < until);
	return 0;
}

/* records committed in [0, wc): the first uncommitted number */
static uint64_t newest(struct sg_ring_header *h)
{
	return atomic_load(&h->write_counter);
}

static int stderr_lines(const char *file, const char *needle)
{
	char line[1024];
	int n = 0;
	FILE *f = fopen(file, "r");

	while (f && fgets(line, sizeof(line), f))
		if (strstr(line, "slurmguard:"))
			n += !needle || strstr(line, needle) ? 1 : 0;
	if (f)
		fclose(f);
	return n;
}

static uint64_t gpu_dur(const struct sg_record *r)
{
	return r->gpu_end_ns - r->gpu_start_ns;
}

/* on a failed check: what records [from, to) hold, and the timing state */
static void dump_records(struct sg_ring_header *h, uint64_t from, uint64_t to)
{
	struct sg_record r;
	uint64_t n;

	fprintf(stderr, "records %llu..%llu (newest %llu): gpu_state %u gpu_lost %llu in_flight %u\n",
		(unsigned long long)from, (unsigned long long)to, (unsigned long long)newest(h),
		atomic_load(&h->gpu_state), (unsigned long long)atomic_load(&h->gpu_lost),
		atomic_load(&h->in_flight));
	for (n = from; n < to; n++) {
		int rc = sg_ring_read(h, n, &r);

		fprintf(stderr, "  %llu: read %d op %u flags %#x gpu %llu\n", (unsigned long long)n,
			rc, rc ? 0 : r.op, rc ? 0 : r.flags,
			rc ? 0ull : (unsigned long long)gpu_dur(&r));
	}
}

static ncclComm_t make_comm(int nranks, int rank, const ncclUniqueId *given)
{
	ncclUniqueId uid;
	ncclComm_t comm = NULL;

	if (given)
		uid = *given;
	else
		ncclGetUniqueId(&uid);
	CHECK(ncclCommInitRank(&comm, nranks, uid, rank) == ncclSuccess, "init");
	return comm;
}

/* the op-count-th allreduce record's number (skips meta records) */
static int find_op(struct sg_ring_header *h, uint16_t op, int nth, struct sg_record *out,
		   uint64_t timeout)
{
	uint64_t n, wc = newest(h);
	int seen = 0;

	for (n = 0; n < wc; n++) {
		if (!wait_record(h, n, out, timeout))
			return 0;
		if (out->op == op && seen++ == nth)
			return 1;
	}
	return 0;
}

/* ------------------------------------------------------------------ timing */

struct mt_arg {
	ncclComm_t comm;
	cudaStream_t stream;
};

static void *mt_worker(void *p)
{
	struct mt_arg *a = p;
	float in = 1, out;
	int i;

	for (i = 0; i < 25; i++)
		ncclAllReduce(&in, &out, 1, ncclFloat32, ncclSum, a->comm, a->stream);
	return NULL;
}

static int scenario_timing(void)
{
	struct sg_ring_header *h;
	struct sg_record r;
	cudaStream_t s, c;
	cudaGraph_t g = NULL;
	ncclComm_t comm;
	uint64_t t0, t1, n;
	ncclResult_t rc;
	int i;

	comm = make_comm(1, 0, NULL);
	/* nothing touches CUDA before the first collective: the runtime may
	 * not be initialised yet, and initialising it is the job's business */
	CHECK(fakeCudaCalls(NULL) == 0, "%llu CUDA calls before the first collective",
	      fakeCudaCalls(NULL));
	cudaSetDevice(0);
	cudaStreamCreate(&s);
	/* the first call sets timing up (pool, reference event, thread) */
	fakeNcclSetTiming(0, 0);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);

	/* 5 us to enqueue, 20 ms on the stream: recorded as 20 ms */
	fakeNcclSetTiming(5 * US, 20 * MS);
	t0 = sg_mono_ns();
	rc = ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	t1 = sg_mono_ns();
	CHECK(rc == ncclSuccess && fout[7] == 8, "rc %d result %f", rc, fout[7]);
	CHECK(t1 - t0 < 10 * MS, "the call took %llu ns (waited for the GPU?)",
	      (unsigned long long)(t1 - t0));
	h = open_ring(0);
	if (!h)
		return 1;
	CHECK(find_op(h, SG_OP_ALLREDUCE, 1, &r, 3000 * MS), "allreduce record");
	CHECK(r.flags == SG_F_GPU_TIME, "flags %#x", r.flags);
	CHECK(r.end_ns - r.start_ns >= 5 * US && r.end_ns - r.start_ns < 2 * MS,
	      "host (enqueue) time %llu ns", (unsigned long long)(r.end_ns - r.start_ns));
	CHECK(gpu_dur(&r) >= 20 * MS - 5 * US && gpu_dur(&r) < 60 * MS, "GPU time %llu ns, want 20 ms",
	      (unsigned long long)gpu_dur(&r));
	/* on the host's clock: right after the call (the fake GPU is a thread,
	 * late by scheduling on a busy machine; a bad conversion is seconds off) */
	CHECK(r.gpu_start_ns + 50 * MS >= r.start_ns && r.gpu_start_ns < r.end_ns + 50 * MS,
	      "GPU start %lld ns after the call", (long long)(r.gpu_start_ns - r.start_ns));
	CHECK(atomic_load(&h->gpu_state) == SG_GPU_ON, "gpu_state %u", atomic_load(&h->gpu_state));

	/* the default stream */
	fakeNcclSetTiming(0, 3 * MS);
	CHECK(ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, NULL) == ncclSuccess, "rc");
	CHECK(find_op(h, SG_OP_ALLREDUCE, 2, &r, 3000 * MS), "default stream record");
	CHECK((r.flags & SG_F_GPU_TIME) && gpu_dur(&r) >= 3 * MS - 5 * US && gpu_dur(&r) < 40 * MS,
	      "default stream: flags %#x GPU %llu ns", r.flags, (unsigned long long)gpu_dur(&r));

	/* in flight until its GPU work has run (SG_HF_IN_FLIGHT): a collective
	 * the GPU is still running reads as in flight since its call, and as
	 * nothing in flight once its record is committed */
	CHECK(atomic_load(&h->header_flags) & SG_HF_IN_FLIGHT, "header_flags %#x",
	      atomic_load(&h->header_flags));
	fakeNcclSetTiming(0, 300 * MS);
	t0 = sg_mono_ns();
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	t1 = sg_mono_ns();
	{
		uint32_t k = atomic_load(&h->in_flight);
		uint64_t since = atomic_load(&h->in_flight_since_ns);

		CHECK(k == 1 && since >= t0 && since <= t1, "in flight %u since %lld ns after the call",
		      k, (long long)(since - t0));
	}
	CHECK(find_op(h, SG_OP_ALLREDUCE, 3, &r, 3000 * MS) && (r.flags & SG_F_GPU_TIME),
	      "300 ms record: flags %#x", r.flags);
	CHECK(atomic_load(&h->in_flight) == 0 && atomic_load(&h->in_flight_since_ns) == 0,
	      "after the record: in flight %u since %llu", atomic_load(&h->in_flight),
	      (unsigned long long)atomic_load(&h->in_flight_since_ns));

	/* a group: launched at ncclGroupEnd, timed as a whole there */
	fakeNcclSetTiming(0, 4 * MS);
	ncclGroupStart();
	ncclSend(fin, 8, ncclFloat32, 0, comm, s);
	ncclRecv(fout, 8, ncclFloat32, 0, comm, s);
	ncclGroupEnd();
	CHECK(find_op(h, SG_OP_GROUP_END, 0, &r, 3000 * MS), "group_end record");
	CHECK((r.flags & SG_F_GPU_TIME) && gpu_dur(&r) >= 8 * MS - 5 * US && gpu_dur(&r) < 50 * MS,
	      "group: flags %#x GPU %llu ns, want 8 ms", r.flags, (unsigned long long)gpu_dur(&r));
	CHECK(find_op(h, SG_OP_SEND, 0, &r, 100 * MS) && r.flags == SG_F_IN_GROUP,
	      "send in group: flags %#x", r.flags);

	/* capture on stream c (global mode) while events of stream s are in
	 * flight and polled: the capture stays valid and holds NCCL's kernel */
	fakeNcclSetTiming(0, 40 * MS);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	cudaStreamCreate(&c);
	CHECK(cudaStreamBeginCapture(c, cudaStreamCaptureModeGlobal) == cudaSuccess, "begin capture");
	rc = ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, c);
	sleep_ns(15 * MS); /* the completion thread polls meanwhile */
	CHECK(rc == ncclSuccess, "captured allreduce rc %d", rc);
	CHECK(cudaStreamEndCapture(c, &g) == cudaSuccess && g, "capture invalidated (%u)",
	      fakeCudaInvalidated());
	CHECK(fakeCudaGraphNodes(g) == 1, "graph holds %u kernels, want 1", fakeCudaGraphNodes(g));
	CHECK(fakeCudaInvalidated() == 0, "%u captures invalidated", fakeCudaInvalidated());
	cudaGraphDestroy(g);
	CHECK(find_op(h, SG_OP_ALLREDUCE, 5, &r, 3000 * MS), "captured record");
	CHECK(r.flags == SG_F_CAPTURED, "captured call: flags %#x", r.flags);
	CHECK(find_op(h, SG_OP_ALLREDUCE, 4, &r, 3000 * MS), "record before capture");
	CHECK((r.flags & SG_F_GPU_TIME) && gpu_dur(&r) >= 40 * MS - 5 * US,
	      "in flight during capture: flags %#x GPU %llu", r.flags,
	      (unsigned long long)gpu_dur(&r));

	/* several threads, each with its own stream */
	{
		pthread_t th[4];
		struct mt_arg a[4];
		uint64_t n0 = newest(h), gpu = 0, ar = 0;

		fakeNcclSetTiming(0, 200 * US);
		for (i = 0; i < 4; i++) {
			a[i].comm = comm;
			cudaStreamCreate(&a[i].stream);
			pthread_create(&th[i], NULL, mt_worker, &a[i]);
		}
		for (i = 0; i < 4; i++)
			pthread_join(th[i], NULL);
		/* a call from this thread closes the others' reservation blocks */
		fakeNcclSetTiming(0, 0);
		ncclAllReduce(fin, fout, 1, ncclFloat32, ncclSum, comm, s);
		/* the completion thread may still be publishing records when this
		 * looks (a loaded machine): read on until all 101 or 3 s */
		{
			uint64_t until = sg_mono_ns() + 3000 * MS;

			for (n = n0; ar < 101 && sg_mono_ns() < until;) {
				if (n >= newest(h)) {
					sleep_ns(1 * MS);
					continue;
				}
				if (!wait_record(h, n, &r, 3000 * MS))
					break;
				if (r.op == SG_OP_ALLREDUCE) {
					ar++;
					gpu += (r.flags & SG_F_GPU_TIME) != 0;
				}
				n++;
			}
		}
		CHECK(ar == 101 && gpu == 101, "threads: %llu allreduce records, %llu with GPU time",
		      (unsigned long long)ar, (unsigned long long)gpu);
		if (ar != 101 || gpu != 101)
			dump_records(h, n0, newest(h));
	}

	/* another device: the pool's events belong to device 0; host times */
	{
		cudaStream_t s1;

		cudaSetDevice(1);
		cudaStreamCreate(&s1);
		n = newest(h);
		fakeNcclSetTiming(0, 1 * MS);
		CHECK(ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s1) == ncclSuccess,
		      "device 1 rc");
		CHECK(wait_record(h, n, &r, 3000 * MS) && r.flags == SG_F_NO_EVENT,
		      "device 1: flags %#x", r.flags);
		cudaSetDevice(0);
		CHECK(atomic_load(&h->gpu_state) == SG_GPU_ON, "still on for device 0");
	}

	/* destroyed with events in flight: the record still completes */
	fakeNcclSetTiming(0, 30 * MS);
	n = newest(h);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroy");
	{
		/* r still holds the previous record if this one never commits */
		int seen = wait_record(h, n, &r, 3000 * MS);
		int ok = seen && r.op == SG_OP_ALLREDUCE && (r.flags & SG_F_GPU_TIME) &&
			 gpu_dur(&r) >= 30 * MS - 5 * US;

		CHECK(ok, "after destroy: record %llu %s op %u flags %#x GPU %llu", (unsigned long long)n,
		      seen ? "read" : "not committed in 3 s", seen ? r.op : 0, seen ? r.flags : 0,
		      seen ? (unsigned long long)gpu_dur(&r) : 0ull);
		if (!ok)
			dump_records(h, n > 8 ? n - 8 : 0, newest(h));
	}
	CHECK(atomic_load(&h->gpu_lost) == 0, "lost %llu",
	      (unsigned long long)atomic_load(&h->gpu_lost));
	return 0;
}

/* ------------------------------------------------------------------ slow peer */

static uint64_t g_go_ns; /* both ranks start their step at this time */

static int scenario_rank(int rank, const ncclUniqueId *uid)
{
	struct sg_ring_header *h;
	struct sg_record r;
	cudaStream_t s;
	ncclComm_t comm;
	struct timespec go = { (time_t)(g_go_ns / 1000000000ull), (long)(g_go_ns % 1000000000ull) };

	comm = make_comm(2, rank, uid);
	cudaSetDevice(0);
	cudaStreamCreate(&s);
	/* a warm-up collective: both processes are up and timing is on */
	fakeNcclSetTiming(0, 0);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	cudaStreamSynchronize(s);
	clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &go, NULL);
	/* the step's compute: rank 1 is the slow one */
	fakeCudaLaunch(s, rank == 1 ? 80 * MS : 1 * MS, NULL, NULL);
	fakeNcclSetTiming(5 * US, 2 * MS);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	h = open_ring(rank);
	if (!h)
		return 1;
	CHECK(find_op(h, SG_OP_ALLREDUCE, 1, &r, 5000 * MS) && (r.flags & SG_F_GPU_TIME),
	      "rank %d: record flags %#x", rank, r.flags);
	return 0;
}

static void check_slow_peer(void)
{
	struct sg_ring_header *h0 = open_ring(0), *h1 = open_ring(1);
	struct sg_record a, b;

	if (!h0 || !h1)
		return;
	CHECK(find_op(h0, SG_OP_ALLREDUCE, 1, &a, 100 * MS), "rank 0 record");
	CHECK(find_op(h1, SG_OP_ALLREDUCE, 1, &b, 100 * MS), "rank 1 record");
	/* both enqueued at once and in microseconds ... */
	CHECK(a.end_ns - a.start_ns < 2 * MS && b.end_ns - b.start_ns < 2 * MS,
	      "host times %llu / %llu", (unsigned long long)(a.end_ns - a.start_ns),
	      (unsigned long long)(b.end_ns - b.start_ns));
	/* ... rank 0 waited on the GPU for rank 1 ... */
	CHECK(gpu_dur(&a) >= 70 * MS, "rank 0 GPU time %llu ns: the wait is not visible",
	      (unsigned long long)gpu_dur(&a));
	/* ... rank 1 started late and ran only the transfer */
	CHECK(gpu_dur(&b) >= 2 * MS - 5 * US && gpu_dur(&b) < 40 * MS, "rank 1 GPU time %llu ns",
	      (unsigned long long)gpu_dur(&b));
	CHECK(b.gpu_start_ns > a.gpu_start_ns + 60 * MS, "rank 1 started %lld ns after rank 0",
	      (long long)(b.gpu_start_ns - a.gpu_start_ns));
	/* the fake streams stamp events when their worker threads get a core: two
	 * processes' workers can run tens of ms apart on a loaded host; ends that
	 * did not wait for each other would be the 79 ms compute gap apart */
	CHECK(b.gpu_end_ns + 40 * MS > a.gpu_end_ns && a.gpu_end_ns + 40 * MS > b.gpu_end_ns,
	      "ends %llu apart", (unsigned long long)(a.gpu_end_ns - b.gpu_end_ns));
	printf("test_hook_cuda: slow peer: rank 0 GPU %.1f ms (host %.3f ms), rank 1 GPU %.1f ms, "
	       "late by %.1f ms\n", gpu_dur(&a) / 1e6, (a.end_ns - a.start_ns) / 1e6,
	       gpu_dur(&b) / 1e6, (b.gpu_start_ns - a.gpu_start_ns) / 1e6);
}

/* ------------------------------------------------------------------ turning off */

static int scenario_pool(void)
{
	struct sg_ring_header *h;
	struct sg_record r;
	ncclComm_t comm = make_comm(1, 0, NULL);
	cudaStream_t s;
	int i, gpu = 0, noev = 0, ok = 1;

	cudaStreamCreate(&s);
	fakeNcclSetTiming(0, 30 * MS);
	for (i = 0; i < 10; i++) {
		fout[0] = 0;
		ok &= ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s) == ncclSuccess &&
		      fout[0] == 1;
	}
	CHECK(ok, "results or return codes changed");
	h = open_ring(0);
	if (!h)
		return 1;
	for (i = 0; i < 10; i++) {
		CHECK(find_op(h, SG_OP_ALLREDUCE, i, &r, 3000 * MS), "record %d", i);
		gpu += (r.flags & SG_F_GPU_TIME) != 0;
		noev += (r.flags & SG_F_NO_EVENT) != 0;
	}
	/* 4 pairs: the first 4 calls are timed, then timing is off */
	CHECK(gpu == 4 && noev == 6, "%d timed, %d without events", gpu, noev);
	CHECK(atomic_load(&h->gpu_state) == SG_GPU_POOL, "gpu_state %u", atomic_load(&h->gpu_state));
	CHECK(atomic_load(&h->gpu_lost) == 0, "lost %llu",
	      (unsigned long long)atomic_load(&h->gpu_lost));
	/* host times only now: the in-flight count no longer says anything */
	CHECK(!(atomic_load(&h->header_flags) & SG_HF_IN_FLIGHT) && atomic_load(&h->in_flight) == 0,
	      "header_flags %#x in flight %u", atomic_load(&h->header_flags),
	      atomic_load(&h->in_flight));
	return 0;
}

static int scenario_cudaerr(void)
{
	struct sg_ring_header *h;
	struct sg_record r;
	ncclComm_t comm = make_comm(1, 0, NULL);
	cudaStream_t s;
	ncclResult_t rc;
	int i;

	cudaStreamCreate(&s);
	fakeNcclSetTiming(0, 20 * MS);
	/* a device fault: every elapsed-time read from now on fails (only the
	 * completion thread reads them) */
	fakeCudaFail("cudaEventElapsedTime", cudaErrorIllegalAddress, 0);
	h = NULL;
	for (i = 0; i < 4; i++) {
		rc = ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
		CHECK(rc == ncclSuccess, "call %d rc %d", i, rc);
		if (i == 0) {
			uint64_t until = sg_mono_ns() + 3000 * MS;

			/* the completion thread meets the error (waited for, not
			 * slept on: a loaded machine may not run it for a while) */
			if (!(h = open_ring(0)))
				return 1;
			while (atomic_load(&h->gpu_state) != SG_GPU_CUDA_ERROR && sg_mono_ns() < until)
				sleep_ns(1 * MS);
		}
	}
	for (i = 0; i < 4; i++) {
		CHECK(find_op(h, SG_OP_ALLREDUCE, i, &r, 3000 * MS), "record %d", i);
		CHECK(r.flags == SG_F_NO_EVENT, "record %d flags %#x", i, r.flags);
	}
	CHECK(atomic_load(&h->gpu_state) == SG_GPU_CUDA_ERROR &&
		      atomic_load(&h->gpu_error) == cudaErrorIllegalAddress,
	      "state %u error %d", atomic_load(&h->gpu_state), atomic_load(&h->gpu_error));
	/* the first call's events were in flight when timing went off */
	CHECK(atomic_load(&h->gpu_lost) == 1, "lost %llu",
	      (unsigned long long)atomic_load(&h->gpu_lost));
	return 0;
}

static int scenario_exit(void)
{
	ncclComm_t comm = make_comm(1, 0, NULL);
	cudaStream_t s1, s2;

	cudaStreamCreate(&s1);
	cudaStreamCreate(&s2);
	fakeNcclSetTiming(0, 5000 * MS);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s1);
	fakeNcclSetTiming(0, 0);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s2);
	/* done on the GPU, maybe not yet seen by the completion thread: the
	 * exit handler commits it */
	cudaStreamSynchronize(s2);
	exit(7);
}

static void check_exit(uint64_t took)
{
	struct sg_ring_header *h = open_ring(0);
	struct sg_record r;

	CHECK(took < 1500 * MS, "exit took %llu ms with a 5 s collective in flight",
	      (unsigned long long)(took / MS));
	if (!h)
		return;
	CHECK(find_op(h, SG_OP_ALLREDUCE, 0, &r, 10 * MS) && r.flags == SG_F_NO_EVENT,
	      "unfinished record: flags %#x", r.flags);
	CHECK(find_op(h, SG_OP_ALLREDUCE, 1, &r, 10 * MS) && r.flags == SG_F_GPU_TIME,
	      "finished record: flags %#x", r.flags);
	CHECK(atomic_load(&h->gpu_lost) == 1, "lost %llu",
	      (unsigned long long)atomic_load(&h->gpu_lost));
}

static int scenario_killed(void)
{
	ncclComm_t comm = make_comm(1, 0, NULL);
	cudaStream_t s;
	int i;

	cudaStreamCreate(&s);
	fakeNcclSetTiming(0, 1 * MS);
	for (i = 0; i < 3; i++)
		ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	cudaStreamSynchronize(s);
	sleep_ns(20 * MS); /* the three are committed */
	fakeNcclSetTiming(0, 5000 * MS);
	ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s);
	{
		char path[512];
		int fd;

		snprintf(path, sizeof(path), "%s/inflight", g_dir);
		fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
		if (fd >= 0)
			close(fd);
	}
	for (;;)
		sleep_ns(1000 * MS); /* killed here */
	return 0;
}

static void check_killed(void)
{
	struct sg_ring_header *h = open_ring(0);
	struct sg_record r;
	uint64_t n, wc;
	int ok = 0;

	if (!h)
		return;
	wc = atomic_load(&h->write_counter);
	for (n = 0; n < wc; n++) {
		enum sg_read_result res = sg_ring_read(h, n, &r);

		if (res == SG_READ_OK && r.op == SG_OP_ALLREDUCE)
			ok += r.flags == SG_F_GPU_TIME;
		else if (res == SG_READ_OK)
			continue;
		else
			break;
	}
	CHECK(ok == 3, "%d finished records intact", ok);
	CHECK(n < wc && sg_ring_read(h, n, &r) == SG_READ_NOT_YET,
	      "the killed call is an uncommitted hole (record %llu of %llu)", (unsigned long long)n,
	      (unsigned long long)wc);
}

static int scenario_disabled(void)
{
	struct sg_ring_header *h;
	struct sg_record r;
	ncclComm_t comm = make_comm(1, 0, NULL);
	cudaStream_t s;

	cudaStreamCreate(&s);
	fakeNcclSetTiming(0, 1 * MS);
	CHECK(ncclAllReduce(fin, fout, 8, ncclFloat32, ncclSum, comm, s) == ncclSuccess, "rc");
	h = open_ring(0);
	if (!h)
		return 1;
	CHECK(find_op(h, SG_OP_ALLREDUCE, 0, &r, 3000 * MS) && r.flags == SG_F_NO_EVENT,
	      "flags %#x", r.flags);
	CHECK(atomic_load(&h->gpu_state) == SG_GPU_DISABLED, "gpu_state %u",
	      atomic_load(&h->gpu_state));
	CHECK(fakeCudaCalls("cudaEventCreateWithFlags") == 0, "events made while disabled");
	return 0;
}

/* ------------------------------------------------------------------ driver */

/* Run fn (or the rank function) in a child with its own ring dir and
 * stderr file. Returns the child's wait status. */
static pid_t start_child(const char *name, int (*fn)(void), int rank, const ncclUniqueId *uid,
			 const char *events)
{
	pid_t pid;
	char errfile[512];

	snprintf(errfile, sizeof(errfile), "%s/%s.stderr", g_dir, name);
	fflush(stdout);
	pid = fork();
	if (pid == 0) {
		int fd = open(errfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		char rbuf[16];

		check_failures = 0; /* the child's own count */
		check_count = 0;
		if (fd >= 0)
			dup2(fd, 2);
		snprintf(rbuf, sizeof(rbuf), "%d", rank);
		setenv("RANK", rbuf, 1);
		if (events)
			setenv("SLURMGUARD_CUDA_EVENTS", events, 1);
		_exit(fn ? fn() + (check_failures ? 1 : 0) :
			   scenario_rank(rank, uid) + (check_failures ? 1 : 0));
	}
	return pid;
}

static void copy_stderr(const char *name);

static int run(const char *name, int (*fn)(void), const char *events)
{
	int st = 0;
	pid_t pid;

	test_dir_clean(g_dir);
	pid = start_child(name, fn, 0, NULL, events);
	waitpid(pid, &st, 0);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "scenario %s: status %#x (its stderr above)",
	      name, st);
	if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
		copy_stderr(name);
	return st;
}

static void copy_stderr(const char *name)
{
	char path[512], line[1024];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s.stderr", g_dir, name);
	f = fopen(path, "r");
	while (f && fgets(line, sizeof(line), f))
		fputs(line, stderr);
	if (f)
		fclose(f);
}

int main(void)
{
	char errfile[512];
	ncclUniqueId uid;
	int st;

	snprintf(g_dir, sizeof(g_dir), "/tmp/sg-test-cuda-XXXXXX");
	test_dir_make(g_dir);
	setenv("SLURMGUARD_STEP_ID", "0", 1);
	setenv("WORLD_SIZE", "2", 1);
	setenv("FAKE_NCCL_CLIQUE_DIR", g_dir, 1);

	run("timing", scenario_timing, NULL);
	snprintf(errfile, sizeof(errfile), "%s/timing.stderr", g_dir);
	CHECK(stderr_lines(errfile, NULL) == 0, "timing scenario wrote to stderr");

	/* two ranks of one communicator, in two processes */
	test_dir_clean(g_dir);
	ncclGetUniqueId(&uid);
	g_go_ns = sg_mono_ns() + 500 * MS;
	{
		pid_t p0 = start_child("rank0", NULL, 0, &uid, NULL);
		pid_t p1 = start_child("rank1", NULL, 1, &uid, NULL);
		int s0 = 0, s1 = 0;

		waitpid(p0, &s0, 0);
		waitpid(p1, &s1, 0);
		CHECK(WIFEXITED(s0) && WEXITSTATUS(s0) == 0 && WIFEXITED(s1) &&
			      WEXITSTATUS(s1) == 0, "rank processes: %#x %#x", s0, s1);
		copy_stderr("rank0");
		copy_stderr("rank1");
		check_slow_peer();
	}

	run("pool", scenario_pool, "4");
	snprintf(errfile, sizeof(errfile), "%s/pool.stderr", g_dir);
	CHECK(stderr_lines(errfile, NULL) == 1 && stderr_lines(errfile, "pool exhausted") == 1,
	      "pool: want one stderr line");

	/* SLURMGUARD_CUDA_EVENTS=0: off by choice, silently */
	run("disabled", scenario_disabled, "0");
	snprintf(errfile, sizeof(errfile), "%s/disabled.stderr", g_dir);
	CHECK(stderr_lines(errfile, NULL) == 0, "disabled: stderr lines");

	run("cudaerr", scenario_cudaerr, NULL);
	snprintf(errfile, sizeof(errfile), "%s/cudaerr.stderr", g_dir);
	CHECK(stderr_lines(errfile, NULL) == 1 && stderr_lines(errfile, "CUDA error 700") == 1,
	      "cudaerr: want one stderr line");

	test_dir_clean(g_dir);
	{
		uint64_t t0 = sg_mono_ns(), took;
		pid_t pid = start_child("exit", scenario_exit, 0, NULL, NULL);

		waitpid(pid, &st, 0);
		took = sg_mono_ns() - t0;
		CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 7, "exit status %#x, want 7", st);
		check_exit(took);
	}
	test_dir_clean(g_dir);
	{
		pid_t pid = start_child("killed", scenario_killed, 0, NULL, NULL);
		uint64_t until = sg_mono_ns() + 10000 * MS;
		char marker[512];

		/* kill once the long collective is in flight */
		snprintf(marker, sizeof(marker), "%s/inflight", g_dir);
		while (sg_mono_ns() < until && access(marker, F_OK) != 0)
			sleep_ns(5 * MS);
		sleep_ns(20 * MS);
		kill(pid, SIGKILL);
		waitpid(pid, &st, 0);
		CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "killed: status %#x", st);
		check_killed();
	}
	test_dir_remove(g_dir);
	DONE("test_hook_cuda");
}
