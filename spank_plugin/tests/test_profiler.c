/*
 * test_profiler.c - libslurmguard_nccl_profiler.so under the fake NCCL,
 * which loads it from NCCL_PROFILER_PLUGIN and drives it as NCCL's
 * profiler interface documents (fake_nccl.c, "profiler"), with the hook
 * preloaded as the SPANK plugin sets both up.
 *
 *   LD_PRELOAD=libslurmguard_nccl.so NCCL_PROFILER_PLUGIN=/abs/plugin.so \
 *   FAKE_NCCL_PROFILER_MAX=6|5|4|3 test_profiler
 *
 * With interface v4 and later (NCCL 2.27+): the plugin writes the ncclprof
 * ring and the hook records no call (one writer); a collective that
 * enqueues in 5 us and runs 20 ms is recorded as 20 ms from the kernel's
 * channel timers; NCCL's sequence numbers; one peer_xfer record per peer
 * and direction, never one per step, whose network time shows the slow
 * link; the hold control word works through the plugin; the header's
 * in-flight count (in a child process with a ring of its own, so the main
 * ring stays what tests/test_hook_ring_format.py reads back): an operation
 * is in flight until its kernel channels have stopped, the count keeps the
 * first start while operations overlap, and operations written at
 * finalize or overflow leave it at 0. With v3 only (NCCL 2.26) NCCL finds
 * no interface it knows: the hook records as before.
 */
#define _GNU_SOURCE

#include <sys/wait.h>

#include "testlib.h"


#define NCOLL 5
#define STEPS (NCOLL * 2 /* channels */ * 4 /* steps */)
#define MAX_WAITING 4096 /* nccl_profiler.c's: operations waiting per communicator */

static char g_dir[512] = "/tmp/sg-test-prof-XXXXXX";
static char g_flight_dir[512] = "/tmp/sg-test-prof-flight-XXXXXX";
static int g_keep; /* SG_TEST_RING_DIR: write there and keep the rings */

static struct sg_ring_header *try_ring(const char *source)
{
	return test_ring(g_dir, 0, "0", source, 0);
}

static void cleanup(void)
{
	if (!g_keep)
		test_dir_remove(g_dir);
}

/* ------------------------------------------------------------------ in flight */

/* the fake NCCL's late peer (tests/fake_nccl.c) */
void fakeNcclPeerLate(ncclComm_t comm, int late);
int fakeNcclKernelsWaiting(ncclComm_t comm);

static void check_idle(struct sg_ring_header *h, const char *when)
{
	CHECK(atomic_load(&h->in_flight) == 0 && atomic_load(&h->in_flight_since_ns) == 0,
	      "%s: in flight %u since %llu", when, atomic_load(&h->in_flight),
	      (unsigned long long)atomic_load(&h->in_flight_since_ns));
}

/* The newest committed record of op; 0 if there is none. */
static int newest(struct sg_ring_header *h, uint16_t op, struct sg_record *out)
{
	uint64_t n = atomic_load(&h->write_counter);
	struct sg_record r;

	while (n-- > 0) {
		if (sg_ring_read(h, n, &r) == SG_READ_OK && r.op == op) {
			*out = r;
			return 1;
		}
	}
	return 0;
}

/* Until comm has n kernels on the GPU waiting for its late peer (their
 * channels started, none stopped); 0 if that never happens. */
static int kernels_waiting(ncclComm_t comm, int n)
{
	int k;

	for (k = 0; k < 10000 && fakeNcclKernelsWaiting(comm) < n; k++)
		sleep_ns(100 * US);
	return fakeNcclKernelsWaiting(comm) == n;
}

/* A collective (p2p: a send) whose kernel waits for a late peer: enqueued
 * and stopped on the host in microseconds, in flight while its kernel
 * channels run, recorded with its GPU times once they stopped. */
static void in_flight_one(struct sg_ring_header *h, ncclComm_t comm, cudaStream_t s, int p2p)
{
	const char *what = p2p ? "send" : "allreduce";
	uint16_t op = p2p ? SG_OP_SEND : SG_OP_ALLREDUCE;
	float in[16] = { 1 }, out[16];
	int before = test_count_op(h, op);
	uint64_t t0, t1, since;
	struct sg_record r = { 0 };

	fakeNcclSetTiming(5 * US, 1 * MS);
	fakeNcclPeerLate(comm, 1);
	t0 = sg_mono_ns();
	if (p2p)
		CHECK(ncclSend(in, 16, ncclFloat32, 1, comm, s) == ncclSuccess, "send");
	else
		CHECK(ncclAllReduce(in, out, 16, ncclFloat32, ncclSum, comm, s) == ncclSuccess,
		      "allreduce");
	t1 = sg_mono_ns();
	CHECK(kernels_waiting(comm, 1), "%s: its kernel never started", what);
	since = atomic_load(&h->in_flight_since_ns);
	CHECK(atomic_load(&h->in_flight) == 1 && since >= t0 && since <= t1,
	      "%s waiting: in flight %u since %lld ns after the call", what,
	      atomic_load(&h->in_flight), (long long)(since - t0));
	CHECK(atomic_load(&h->header_flags) & SG_HF_IN_FLIGHT, "%s waiting: header_flags %#x",
	      what, atomic_load(&h->header_flags));
	CHECK(test_count_op(h, op) == before, "%s recorded before its kernel ended", what);
	fakeNcclPeerLate(comm, 0);
	cudaStreamSynchronize(s);
	check_idle(h, what);
	CHECK(newest(h, op, &r) && test_count_op(h, op) == before + 1 && r.start_ns == since &&
		      r.flags == SG_F_GPU_TIME,
	      "%s record: start %lld ns from the in-flight start, flags %#x", what,
	      (long long)(r.start_ns - since), r.flags);
}

/* Collectives of two communicators in flight at once: the count says since
 * the first started, also once the first is recorded and the second still
 * waits. */
static void in_flight_overlap(struct sg_ring_header *h, ncclComm_t comm, cudaStream_t s)
{
	float in[16] = { 1 }, out[16];
	int before = test_count_op(h, SG_OP_ALLREDUCE);
	uint64_t t0, t1, first, since;
	struct sg_record r = { 0 };
	ncclUniqueId uid;
	ncclComm_t other;
	cudaStream_t s2;

	cudaStreamCreate(&s2);
	ncclGetUniqueId(&uid);
	CHECK(ncclCommInitRank(&other, 4, uid, 0) == ncclSuccess, "init");
	fakeNcclSetTiming(5 * US, 1 * MS);
	fakeNcclPeerLate(comm, 1);
	fakeNcclPeerLate(other, 1);
	t0 = sg_mono_ns();
	ncclAllReduce(in, out, 16, ncclFloat32, ncclSum, comm, s);
	t1 = sg_mono_ns();
	ncclAllReduce(in, out, 16, ncclFloat32, ncclSum, other, s2);
	CHECK(kernels_waiting(comm, 1) && kernels_waiting(other, 1), "kernels never started");
	first = atomic_load(&h->in_flight_since_ns);
	CHECK(atomic_load(&h->in_flight) == 2 && first >= t0 && first <= t1,
	      "two waiting: in flight %u since %lld ns after the first call",
	      atomic_load(&h->in_flight), (long long)(first - t0));
	fakeNcclPeerLate(comm, 0);
	cudaStreamSynchronize(s);
	since = atomic_load(&h->in_flight_since_ns);
	CHECK(test_count_op(h, SG_OP_ALLREDUCE) == before + 1 && atomic_load(&h->in_flight) == 1 &&
		      since == first,
	      "first recorded, second waiting: %d records, in flight %u since %lld ns after",
	      test_count_op(h, SG_OP_ALLREDUCE) - before, atomic_load(&h->in_flight),
	      (long long)(since - first));
	fakeNcclPeerLate(other, 0);
	cudaStreamSynchronize(s2);
	check_idle(h, "after both collectives");
	CHECK(newest(h, SG_OP_ALLREDUCE, &r) && r.start_ns > first,
	      "second record starts %lld ns after the first", (long long)(r.start_ns - first));
	CHECK(ncclCommDestroy(other) == ncclSuccess, "destroy");
}

/* A send to oneself (NCCL 2.28.9: a P2p event, never a kernel channel)
 * stays in flight until the communicator is finalised, which writes it
 * with host times. */
static void in_flight_finalize(struct sg_ring_header *h, cudaStream_t s)
{
	float in[16] = { 1 };
	struct sg_record r = { 0 };
	ncclUniqueId uid;
	ncclComm_t one;
	uint64_t t0;

	fakeNcclSetTiming(5 * US, 0);
	ncclGetUniqueId(&uid);
	CHECK(ncclCommInitRank(&one, 1, uid, 0) == ncclSuccess, "init 1-rank");
	t0 = sg_mono_ns();
	CHECK(ncclSend(in, 16, ncclFloat32, 0, one, s) == ncclSuccess, "send to self");
	cudaStreamSynchronize(s);
	CHECK(atomic_load(&h->in_flight) == 1 && atomic_load(&h->in_flight_since_ns) >= t0,
	      "send to self: in flight %u", atomic_load(&h->in_flight));
	CHECK(ncclCommDestroy(one) == ncclSuccess, "destroy 1-rank");
	check_idle(h, "finalize with a send waiting");
	CHECK(newest(h, SG_OP_SEND, &r) && r.flags == SG_F_NO_EVENT && r.peer == 0,
	      "send to self: flags %#x", r.flags);
}

/* MAX_WAITING sends to oneself (no kernel channel ever, as above) push out
 * a collective whose kernel waits for a late peer: it is written with host
 * times and counted done once, its late kernel channels neither record nor
 * count it again; finalize writes the rest. */
static void in_flight_overflow(struct sg_ring_header *h, cudaStream_t s)
{
	float in[16] = { 1 }, out[16];
	int colls, sends, k;
	struct sg_record r = { 0 };
	ncclUniqueId uid;
	ncclComm_t comm;

	ncclGetUniqueId(&uid);
	CHECK(ncclCommInitRank(&comm, 4, uid, 0) == ncclSuccess, "init");
	colls = test_count_op(h, SG_OP_ALLREDUCE);
	sends = test_count_op(h, SG_OP_SEND);
	fakeNcclSetTiming(0, 0);
	fakeNcclPeerLate(comm, 1);
	ncclAllReduce(in, out, 16, ncclFloat32, ncclSum, comm, s);
	CHECK(kernels_waiting(comm, 1), "the collective's kernel never started");
	for (k = 0; k < MAX_WAITING; k++)
		ncclSend(in, 16, ncclFloat32, 0, comm, s);
	CHECK(atomic_load(&h->in_flight) == MAX_WAITING, "at overflow: in flight %u",
	      atomic_load(&h->in_flight));
	k = test_count_op(h, SG_OP_ALLREDUCE) - colls;
	CHECK(k == 1 && newest(h, SG_OP_ALLREDUCE, &r) && r.flags == SG_F_NO_EVENT,
	      "pushed-out collective: %d records, flags %#x", k, r.flags);
	fakeNcclPeerLate(comm, 0);
	cudaStreamSynchronize(s);
	k = test_count_op(h, SG_OP_ALLREDUCE) - colls;
	CHECK(atomic_load(&h->in_flight) == MAX_WAITING && k == 1,
	      "after its kernel: in flight %u, %d records", atomic_load(&h->in_flight), k);
	ncclSend(in, 16, ncclFloat32, 0, comm, s);
	k = test_count_op(h, SG_OP_SEND) - sends;
	CHECK(atomic_load(&h->in_flight) == MAX_WAITING && k == 1,
	      "one more: in flight %u, %d sends written", atomic_load(&h->in_flight), k);
	CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroy");
	check_idle(h, "finalize after overflow");
	CHECK(test_count_op(h, SG_OP_SEND) == sends + MAX_WAITING + 1, "%d sends written",
	      test_count_op(h, SG_OP_SEND) - sends);
}

/* The child's part: a ring of its own (g_flight_dir). */
static int in_flight_tests(int version)
{
	struct sg_ring_header *h;
	ncclUniqueId uid;
	ncclComm_t comm;
	cudaStream_t s;
	char name[64];

	snprintf(name, sizeof(name), "test_profiler in flight (interface <= v%d)", version);
	test_dir_make(g_flight_dir);
	cudaStreamCreate(&s);
	ncclGetUniqueId(&uid);
	CHECK(ncclCommInitRank(&comm, 4, uid, 0) == ncclSuccess, "init");
	h = test_ring(g_flight_dir, 0, "0", "ncclprof", 1);
	if (h) {
		CHECK(atomic_load(&h->header_flags) & SG_HF_IN_FLIGHT, "header_flags %#x",
		      atomic_load(&h->header_flags));
		check_idle(h, "after init");
		in_flight_one(h, comm, s, 0);
		in_flight_one(h, comm, s, 1);
		in_flight_overlap(h, comm, s);
		in_flight_finalize(h, s);
		CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroy");
		in_flight_overflow(h, s);
		check_idle(h, "at the end");
	}
	test_dir_remove(g_flight_dir);
	DONE(name);
}

/* Run in_flight_tests in a child, before this process touches NCCL: the
 * plugin writes one ring per process. */
static void in_flight_child(int version)
{
	pid_t pid;
	int st = 0;

	fflush(stdout);
	pid = fork();
	if (pid == 0)
		exit(in_flight_tests(version));
	CHECK(pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0,
	      "in-flight tests: status %#x", st);
}

int main(void)
{
	const char *maxv = getenv("FAKE_NCCL_PROFILER_MAX");
	int version = maxv ? atoi(maxv) : 6, i;
	float in[16] = { 1 }, out[16];
	struct sg_ring_header *prof, *hook;
	struct sg_record r;
	ncclUniqueId uid;
	ncclComm_t comm;
	cudaStream_t s;
	uint64_t n, wc;
	char name[64];

	if (getenv("SG_TEST_RING_DIR")) {
		snprintf(g_dir, sizeof(g_dir), "%s", getenv("SG_TEST_RING_DIR"));
		g_keep = 1;
		setenv("SLURMGUARD_RING_DIR", g_dir, 1);
	} else {
		test_dir_make(g_dir);
	}
	setenv("SLURMGUARD_STEP_ID", "0", 1);
	setenv("RANK", "0", 1);
	setenv("SLURMGUARD_XFER_INTERVAL_MS", "60000", 1); /* flushed at finalize */
	snprintf(name, sizeof(name), "test_profiler (interface <= v%d)", version);
	if (version >= 4)
		in_flight_child(version);

	/* rank 0 of a 4-rank ring: sends to 1 over a slow link, receives from
	 * 3 over a healthy one */
	fakeNcclSetLink(1, 8 * MS);
	fakeNcclSetLink(3, 50 * US);
	cudaStreamCreate(&s);
	ncclGetUniqueId(&uid);
	CHECK(ncclCommInitRank(&comm, 4, uid, 0) == ncclSuccess, "init");
	fakeNcclSetTiming(5 * US, 20 * MS);
	for (i = 0; i < NCOLL; i++) {
		CHECK(ncclAllReduce(in, out, 16, ncclFloat32, ncclSum, comm, s) == ncclSuccess &&
			      out[0] == 4, "allreduce %d", i);
		cudaStreamSynchronize(s);
	}
	/* a send to the slow peer: one kernel channel, one proxy op */
	fakeNcclSetTiming(5 * US, 2 * MS);
	CHECK(ncclSend(in, 16, ncclFloat32, 1, comm, s) == ncclSuccess, "send");
	cudaStreamSynchronize(s);
	fakeNcclSetTiming(5 * US, 20 * MS);
	prof = try_ring("ncclprof");
	/* the controller holds this rank at its next collective (100 ms) */
	if (prof) {
		prof->hold_timeout_ms = 100;
		atomic_fetch_or(&prof->control, SG_CTL_HOLD);
		ncclAllReduce(in, out, 16, ncclFloat32, ncclSum, comm, s);
		cudaStreamSynchronize(s);
		CHECK(atomic_load(&prof->holds) == 1 && atomic_load(&prof->hold_timeouts) == 1,
		      "hold through the plugin: holds %llu",
		      (unsigned long long)atomic_load(&prof->holds));
	}
	CHECK(ncclCommDestroy(comm) == ncclSuccess, "destroy");
	/* a communicator of one, as recorded under NCCL 2.28.9 on a GPU: its
	 * collectives give the plugin nothing, a send to oneself host times */
	{
		ncclComm_t one;

		ncclGetUniqueId(&uid);
		CHECK(ncclCommInitRank(&one, 1, uid, 0) == ncclSuccess, "init 1-rank");
		CHECK(ncclAllReduce(in, out, 16, ncclFloat32, ncclSum, one, s) == ncclSuccess,
		      "1-rank allreduce");
		CHECK(ncclSend(in, 16, ncclFloat32, 0, one, s) == ncclSuccess, "send to self");
		cudaStreamSynchronize(s);
		CHECK(ncclCommDestroy(one) == ncclSuccess, "destroy 1-rank");
	}
	hook = try_ring("nccl");

	if (version < 4) {
		/* NCCL 2.26 knows only v1..v3: no plugin, the hook records */
		int k;

		CHECK(prof == NULL, "a ring from a plugin NCCL cannot load");
		/* the hook's records come when their GPU events complete (the
		 * 1-rank communicator's all-reduce too) */
		for (k = 0; k < 200 && hook && test_count_op(hook, SG_OP_ALLREDUCE) < NCOLL + 1; k++)
			usleep(10000);
		CHECK(hook && test_count_op(hook, SG_OP_ALLREDUCE) == NCOLL + 1, "hook records: %d",
		      hook ? test_count_op(hook, SG_OP_ALLREDUCE) : -1);
		cleanup();
		DONE(name);
	}
	CHECK(prof != NULL, "no ncclprof ring");
	if (!prof) {
		cleanup();
		DONE(name);
	}
	CHECK(prof->source == SG_SOURCE_NCCL_PROFILER, "source %u", prof->source);
	/* one writer per call: the hook stood down when NCCL loaded the plugin */
	CHECK(!hook || (test_count_op(hook, SG_OP_ALLREDUCE) == 0 && test_count_op(hook, SG_OP_COMM_INIT) == 0),
	      "the hook recorded too: %d allreduce", test_count_op(hook, SG_OP_ALLREDUCE));

	wc = atomic_load(&prof->write_counter);
	/* init, 5 + 1 collectives, send, hold, 2 links, destroy: nothing per
	 * step; then the 1-rank communicator's init, send to self, destroy */
	CHECK(wc == 1 + NCOLL + 1 + 1 + 1 + 2 + 1 + 3, "%llu records", (unsigned long long)wc);
	for (n = 0, i = 0; n < wc; n++) {
		CHECK(sg_ring_read(prof, n, &r) == SG_READ_OK, "record %llu", (unsigned long long)n);
		if (r.op == SG_OP_ALLREDUCE && i < NCOLL) {
			uint64_t gpu = r.gpu_end_ns - r.gpu_start_ns, host = r.end_ns - r.start_ns;

			CHECK(r.flags == SG_F_GPU_TIME, "collective %d flags %#x", i, r.flags);
			CHECK(host >= 5 * US && host < 3 * MS, "collective %d host %llu ns", i,
			      (unsigned long long)host);
			/* 20 ms of kernel plus the ring's steps (~65 ms) */
			CHECK(gpu >= 20 * MS && gpu < 300 * MS, "collective %d GPU %llu ns", i,
			      (unsigned long long)gpu);
			CHECK(r.coll_seq == (uint64_t)i + 1 && r.count == 16 &&
				      r.datatype == SG_DT_FLOAT32 && r.bytes == 64,
			      "collective %d: seq %llu count %llu", i, (unsigned long long)r.coll_seq,
			      (unsigned long long)r.count);
			/* the GPU timer mapped onto the host clock: after the enqueue */
			CHECK(r.gpu_start_ns + 1 * MS >= r.start_ns &&
				      r.gpu_start_ns < r.end_ns + 50 * MS,
			      "collective %d GPU start %lld ns after the call", i,
			      (long long)(r.gpu_start_ns - r.start_ns));
			i++;
		}
	}
	CHECK(i == NCOLL, "%d collectives", i);
	for (n = 0; n < wc; n++) {
		if (sg_ring_read(prof, n, &r) == SG_READ_OK && r.op == SG_OP_SEND) {
			CHECK(r.flags == SG_F_GPU_TIME && r.peer == 1 && r.bytes == 64 &&
				      r.gpu_end_ns - r.gpu_start_ns >= 2 * MS + 4 * 8 * MS,
			      "send: flags %#x peer %d GPU %llu ns", r.flags, r.peer,
			      (unsigned long long)(r.gpu_end_ns - r.gpu_start_ns));
			break;
		}
	}
	CHECK(n < wc, "no send record");
	for (n = wc - 3; n < wc; n++) {
		static const uint16_t want[3] = { SG_OP_COMM_INIT, SG_OP_SEND, SG_OP_COMM_DESTROY };

		CHECK(sg_ring_read(prof, n, &r) == SG_READ_OK && r.op == want[n - (wc - 3)],
		      "1-rank record %llu: op %u", (unsigned long long)n, r.op);
		if (r.op == SG_OP_SEND)
			CHECK(r.flags == SG_F_NO_EVENT && r.peer == 0, "send to self: flags %#x",
			      r.flags);
	}
	CHECK(test_count_op(prof, SG_OP_ALLREDUCE) == NCOLL + 1, "1-rank allreduce recorded");
	{
		struct sg_record slow = { 0 }, fine = { 0 };
		int links = 0;

		for (n = 0; n < wc; n++) {
			if (sg_ring_read(prof, n, &r) != SG_READ_OK || r.op != SG_OP_PEER_XFER)
				continue;
			links++;
			if (r.peer == 1 && (r.flags & SG_F_XFER_SEND))
				slow = r;
			if (r.peer == 3 && !(r.flags & SG_F_XFER_SEND))
				fine = r;
		}
		CHECK(links == 2, "%d peer_xfer records", links);
		/* the hold's collective adds its steps too, the send 4 to peer 1 */
		CHECK(slow.count == STEPS + 8 + 4 && fine.count == STEPS + 8, "steps %llu / %llu",
		      (unsigned long long)slow.count, (unsigned long long)fine.count);
		CHECK(slow.bytes == slow.count * 524288 && slow.xfer_channels == 3 &&
			      slow.xfer_ops == (NCOLL + 1) * 2 + 1,
		      "send aggregate: bytes %llu channels %#llx ops %u",
		      (unsigned long long)slow.bytes, (unsigned long long)slow.xfer_channels,
		      slow.xfer_ops);
		/* per step: 8 ms on the slow link, 50 us on the healthy one */
		CHECK(slow.xfer_net_ns >= slow.count * 8 * MS, "slow link: %llu ns on the network",
		      (unsigned long long)slow.xfer_net_ns);
		/* sleeps overshoot on a busy machine (by up to a millisecond or
		 * so, on either link): compare the difference (7.95 ms per step) */
		CHECK(slow.xfer_net_ns > fine.xfer_net_ns &&
			      slow.xfer_net_ns - fine.xfer_net_ns >= fine.count * 5 * MS,
		      "healthy link %llu ns vs slow %llu ns", (unsigned long long)fine.xfer_net_ns,
		      (unsigned long long)slow.xfer_net_ns);
		CHECK(slow.xfer_peer_wait_ns > 0 && slow.xfer_gpu_wait_ns > 0 && fine.xfer_gpu_wait_ns > 0,
		      "wait buckets %llu %llu %llu", (unsigned long long)slow.xfer_peer_wait_ns,
		      (unsigned long long)slow.xfer_gpu_wait_ns,
		      (unsigned long long)fine.xfer_gpu_wait_ns);
		printf("%s: slow link %.2f ms/step on the network, healthy %.3f ms/step\n", name,
		       slow.xfer_net_ns / 1e6 / (double)slow.count,
		       fine.xfer_net_ns / 1e6 / (double)fine.count);
	}
	CHECK(test_count_op(prof, SG_OP_HOLD) == 1 && test_count_op(prof, SG_OP_COMM_DESTROY) == 2,
	      "hold / destroy records");
	/* every operation ended, the send to oneself by finalize */
	CHECK(atomic_load(&prof->header_flags) & SG_HF_IN_FLIGHT, "header_flags %#x",
	      atomic_load(&prof->header_flags));
	check_idle(prof, "at the end");
	cleanup();
	DONE(name);
}
