/*
 * fake_nccl.c - a small host-memory stand-in for libnccl.so.2, for testing
 * the hook on machines without GPUs. Same entry points, argument order and
 * return codes as NCCL (nccl_api.h); buffers are host memory and streams are
 * ignored.
 *
 * Known answers: every collective behaves as if all nranks ranks passed the
 * same send buffer, so e.g. a sum all-reduce yields x * nranks, an all-gather
 * nranks copies of the input, a recv fills the buffer with (peer + 1).
 *
 * Built twice: the full library, and with -DFAKE_NCCL_OLD an "old NCCL"
 * without ncclAllToAll, ncclCommInitRankConfig, ncclCommInitRankScalable and
 * ncclCommSplit, to test the hook against missing symbols.
 *
 * fakeNcclCalls() reports how often each entry point ran, so tests can check
 * the hook forwarded every call exactly once.
 *
 * GPU model: when the fake CUDA runtime (fake_cudart.c) is loaded too, each
 * collective and p2p call enqueues one kernel on its stream, as NCCL does,
 * and returns: the call itself takes fakeNcclSetTiming's enqueue_ns (host
 * side), the kernel kernel_ns on the stream. Inside ncclGroupStart/End the
 * work is launched at the outermost ncclGroupEnd, on the first call's
 * stream, as one kernel. With FAKE_NCCL_CLIQUE_DIR set, communicators made
 * from the same unique id in different processes form a clique through a
 * shared file: a collective's kernel starts moving data only once every
 * rank's kernel for that collective has started, so a rank that arrives
 * early waits on the GPU for the late one, as in NCCL.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../nccl_api.h"

#define CLIQUE_MAX 64

struct clique {
	_Atomic uint64_t arrived[CLIQUE_MAX]; /* per rank: last collective started */
};

struct ncclComm {
	int rank;
	int nranks;
	struct clique *clique; /* NULL: no other process */
	_Atomic uint64_t seq;  /* the test's threads may share one communicator */
	void *prof;       /* the profiler plugin's context for this communicator */
	uint64_t coll_seq; /* NCCL's per-communicator collective sequence number */
	_Atomic int late;    /* fakeNcclPeerLate: kernels wait for a peer not there */
	_Atomic int waiting; /* kernels waiting so */
};

static int group_depth_tls(void);

typedef int (*launch_fn)(cudaStream_t, uint64_t, void (*)(void *), void *);
static uint64_t enqueue_ns, kernel_ns;
static __thread cudaStream_t group_stream;
static __thread int group_launch;
static __thread uint64_t group_kernel_ns;
static __thread struct ncclComm *group_comm;

/* Test-only: host time each call takes, and its kernel's time on the stream. */
void fakeNcclSetTiming(uint64_t enqueue, uint64_t kernel)
{
	enqueue_ns = enqueue;
	kernel_ns = kernel;
}

static uint64_t mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct wait_arg {
	struct clique *clique;
	int rank, nranks;
	uint64_t seq;
};

/* on "the GPU": announce this rank's arrival, wait for the others */
static void clique_wait(void *p)
{
	struct wait_arg *a = p;
	uint64_t limit = mono_ns() + 10000000000ull;
	struct timespec nap = { 0, 20000 };
	uint64_t seen = atomic_load(&a->clique->arrived[a->rank]);
	int r;

	/* a maximum, not a store: kernels of one rank on several streams
	 * (threads sharing a communicator) finish out of order, and a rank's
	 * arrival must never go back (its own check below would then wait
	 * for itself until the limit) */
	while (seen < a->seq &&
	       !atomic_compare_exchange_weak(&a->clique->arrived[a->rank], &seen, a->seq))
		;
	for (r = 0; r < a->nranks && mono_ns() < limit; r++)
		while (atomic_load(&a->clique->arrived[r]) < a->seq && mono_ns() < limit)
			nanosleep(&nap, NULL);
	free(a);
}

/* the fake CUDA runtime's kernel launch, when it is loaded (looked up once) */
static launch_fn cuda_launch(void)
{
	static launch_fn launch;
	static int looked;

	if (!looked) {
		launch = (launch_fn)dlsym(RTLD_DEFAULT, "fakeCudaLaunch");
		looked = 1;
	}
	return launch;
}

static void launch_now(struct ncclComm *c, cudaStream_t stream, uint64_t ns)
{
	launch_fn launch = cuda_launch();
	struct wait_arg *a = NULL;

	if (!launch)
		return;
	if (c && c->clique && (a = malloc(sizeof(*a)))) {
		a->clique = c->clique;
		a->rank = c->rank;
		a->nranks = c->nranks;
		a->seq = atomic_fetch_add(&c->seq, 1) + 1;
	}
	if (launch(stream, ns, a ? clique_wait : NULL, a) != 0)
		free(a);
}

/* ------------------------------------------------------------------ profiler
 *
 * The profiler plugin, driven as NCCL does: NCCL_PROFILER_PLUGIN names the
 * library (a path is opened as is, a name X as libnccl-profiler-X.so);
 * ncclProfiler_v6, _v5, _v4 are looked up newest first (FAKE_NCCL_PROFILER_MAX
 * caps the version, to play an older NCCL: 4 = 2.27, 3 = 2.26 which knows
 * no version this plugin offers); init per communicator with its hash, an
 * error from init disables the plugin for it; finalize at destroy/abort.
 * Events: Coll/P2p started and stopped in the calling thread around the
 * enqueue; then on "the GPU" (the kernel's stream worker) per channel a
 * KernelCh event with the GPU globaltimer at start and at KernelChStop,
 * and ProxyOp events (send to the next rank, receive from the previous,
 * as in a ring) whose ProxySteps go through NCCL's states with transSize:
 * SendGPUWait -> SendPeerWait_v4 -> SendWait, RecvWait -> RecvFlushWait ->
 * RecvGPUWait. Each step's network time is the link's (fakeNcclSetLink).
 * fakeNcclPeerLate keeps a communicator's kernels waiting after their
 * channels started, as for a peer that has not arrived (a hung collective),
 * until it arrives.
 * As NCCL 2.28.9 did on a real GPU (tests/data/gpu/, recorded with
 * spank_plugin/gpu/run_real.sh): a collective of a one-rank communicator
 * gets no profiler event at all (NCCL's one-rank path, ncclLaunchOneRank,
 * never reaches the kernel plan), and a send/recv to oneself its P2p event
 * but no KernelCh, ProxyOp or ProxyStep event (nothing leaves the GPU).
 */
#include "../nccl_profiler_api.h"

#define PROF_CHANNELS 2
#define PROF_STEPS 4
#define PROF_CHUNK 524288

static int prof_version; /* 0: not loaded (yet), -1: none */
static const ncclProfiler_v4_t *prof4;
static const ncclProfiler_v5_t *prof5;
static uint64_t link_ns[CLIQUE_MAX];

/* Test-only: network time of one step to/from `peer` (ns). */
void fakeNcclSetLink(int peer, uint64_t ns)
{
	if (peer >= 0 && peer < CLIQUE_MAX)
		link_ns[peer] = ns;
}

/* the GPU's globaltimer: nanoseconds on a clock of its own */
static uint64_t gtimer(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + 777000;
}

static void prof_load(void)
{
	const char *name = getenv("NCCL_PROFILER_PLUGIN");
	const char *maxv = getenv("FAKE_NCCL_PROFILER_MAX");
	int max = maxv ? atoi(maxv) : 6;
	char lib[4096];
	void *h;

	prof_version = -1;
	if (!name || !*name)
		return;
	if (strchr(name, '/'))
		snprintf(lib, sizeof(lib), "%s", name);
	else
		snprintf(lib, sizeof(lib), "libnccl-profiler-%s.so", name);
	h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (!h)
		return;
	if (max >= 6 && (prof5 = dlsym(h, "ncclProfiler_v6")))
		prof_version = 6;
	else if (max >= 5 && (prof5 = dlsym(h, "ncclProfiler_v5")))
		prof_version = 5;
	else if (max >= 4 && (prof4 = dlsym(h, "ncclProfiler_v4")))
		prof_version = 4;
}

static uint64_t comm_hash(const ncclUniqueId *id)
{
	unsigned long long h = 0xcbf29ce484222325ull;
	size_t i;

	for (i = 0; i < sizeof(id->internal); i++)
		h = (h ^ (unsigned char)id->internal[i]) * 0x100000001b3ull;
	return h;
}

static void prof_init(struct ncclComm *c, uint64_t hash)
{
	int mask = 0;
	ncclResult_t rc;

	if (!prof_version)
		prof_load();
	if (prof_version == 4)
		rc = prof4->init(&c->prof, &mask, "", hash, 1, c->nranks, c->rank, NULL);
	else if (prof_version >= 5)
		rc = prof5->init(&c->prof, hash, &mask, "", 1, c->nranks, c->rank, NULL);
	else
		return;
	if (rc != ncclSuccess)
		c->prof = NULL;
}

static void prof_finalize(struct ncclComm *c)
{
	if (c->prof && prof_version == 4)
		prof4->finalize(c->prof);
	else if (c->prof)
		prof5->finalize(c->prof);
	c->prof = NULL;
}

/* one event: a descriptor of the version in use */
static void *prof_start(void *ctx, uint64_t type, void *parent, int rank,
			const union sg_nccl_prof_descr_u *u)
{
	void *handle = NULL;

	if (prof_version == 4) {
		ncclProfilerEventDescr_v4_t d;

		memset(&d, 0, sizeof(d));
		d.type = (uint8_t)type;
		d.parentObj = parent;
		d.rank = rank;
		d.u = *u;
		prof4->startEvent(ctx, &handle, &d);
	} else {
		ncclProfilerEventDescr_v5_t d;

		memset(&d, 0, sizeof(d));
		d.type = type;
		d.parentObj = parent;
		d.rank = rank;
		d.u = *u;
		prof5->startEvent(ctx, &handle, &d);
	}
	return handle;
}

static void prof_stop(void *handle)
{
	if (handle)
		(prof_version == 4 ? prof4->stopEvent : prof5->stopEvent)(handle);
}

static void prof_state(void *handle, ncclProfilerEventState_t st, ncclProfilerEventStateArgs_v4_t *a)
{
	if (handle)
		(prof_version == 4 ? prof4->recordEventState : prof5->recordEventState)(handle, st, a);
}

static void nap_ns(uint64_t ns)
{
	struct timespec ts = { (time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull) };

	if (ns)
		nanosleep(&ts, NULL);
}

struct prof_kernel_arg {
	void *ctx, *coll;
	int rank, nranks;
	int channels;   /* kernel channels of the operation */
	int p2p_peer;   /* p2p: the peer (one op on channel 0), else -1: a ring */
	int p2p_send;
	struct wait_arg *wait;
	struct ncclComm *late; /* a peer was late at launch: wait for it */
};

/* Test-only: a peer of comm is late (1) or arrives (0). The kernels of
 * collectives and p2p launched while it is late wait on the GPU, after
 * their channels started, until it arrives. Let it arrive before the
 * communicator is destroyed. */
void fakeNcclPeerLate(ncclComm_t comm, int late)
{
	atomic_store(&comm->late, late);
}

/* Test-only: kernels of comm waiting for the late peer now. */
int fakeNcclKernelsWaiting(ncclComm_t comm)
{
	return atomic_load(&comm->waiting);
}

/* on "the GPU": wait for the late peer (10 s at most, as in clique_wait) */
static void late_wait(struct ncclComm *c)
{
	uint64_t limit = mono_ns() + 10000000000ull;
	struct timespec nap = { 0, 20000 };

	atomic_fetch_add(&c->waiting, 1);
	while (atomic_load(&c->late) && mono_ns() < limit)
		nanosleep(&nap, NULL);
	atomic_fetch_sub(&c->waiting, 1);
}

/* the proxy's view of one ProxyOp on one channel */
static void prof_op(struct prof_kernel_arg *a, int channel, int peer, int send)
{
	union sg_nccl_prof_descr_u u;
	void *op;
	int i;

	memset(&u, 0, sizeof(u));
	u.proxyOp.pid = getpid();
	u.proxyOp.channelId = (uint8_t)channel;
	u.proxyOp.peer = peer;
	u.proxyOp.nSteps = PROF_STEPS;
	u.proxyOp.chunkSize = PROF_CHUNK;
	u.proxyOp.isSend = send;
	op = prof_start(a->ctx, ncclProfileProxyOp, a->coll, a->rank, &u);
	for (i = 0; i < PROF_STEPS; i++) {
		ncclProfilerEventStateArgs_v4_t st = { .proxyStep = { PROF_CHUNK } };
		void *step;

		memset(&u, 0, sizeof(u));
		u.proxyStep.step = i;
		step = prof_start(a->ctx, ncclProfileProxyStep, op, a->rank, &u);
		if (send) {
			prof_state(step, ncclProfilerProxyStepSendGPUWait, &st);
			nap_ns(20000);
			prof_state(step, ncclProfilerProxyStepSendPeerWait_v4, &st);
			nap_ns(10000);
			prof_state(step, ncclProfilerProxyStepSendWait, &st);
			nap_ns(link_ns[peer]);
		} else {
			prof_state(step, ncclProfilerProxyStepRecvWait, &st);
			nap_ns(link_ns[peer]);
			prof_state(step, ncclProfilerProxyStepRecvFlushWait, &st);
			nap_ns(10000);
			prof_state(step, ncclProfilerProxyStepRecvGPUWait, &st);
			nap_ns(20000);
		}
		prof_stop(step);
	}
	prof_stop(op);
}

/* on "the GPU": channels start, wait for the peers, move data, stop */
static void prof_kernel(void *p)
{
	struct prof_kernel_arg *a = p;
	union sg_nccl_prof_descr_u u;
	void *ch[PROF_CHANNELS];
	int i;

	for (i = 0; i < a->channels; i++) {
		memset(&u, 0, sizeof(u));
		u.kernelCh.channelId = (uint8_t)i;
		u.kernelCh.pTimer = gtimer();
		ch[i] = prof_start(a->ctx, ncclProfileKernelCh, a->coll, a->rank, &u);
	}
	if (a->wait)
		clique_wait(a->wait);
	if (a->late)
		late_wait(a->late);
	nap_ns(kernel_ns);
	if (a->p2p_peer >= 0) {
		prof_op(a, 0, a->p2p_peer, a->p2p_send);
	} else {
		for (i = 0; a->nranks > 1 && i < a->channels; i++) {
			prof_op(a, i, (a->rank + 1) % a->nranks, 1);
			prof_op(a, i, (a->rank + a->nranks - 1) % a->nranks, 0);
		}
	}
	for (i = 0; i < a->channels; i++) {
		ncclProfilerEventStateArgs_v4_t st = { .kernelCh = { gtimer() } };

		prof_state(ch[i], ncclProfilerKernelChStop, &st);
		prof_stop(ch[i]);
	}
	free(a);
}

static const char *dt_name(ncclDataType_t dt)
{
	static const char *const names[ncclNumTypes] = {
		"ncclInt8",    "ncclUint8",   "ncclInt32",    "ncclUint32",
		"ncclInt64",   "ncclUint64",  "ncclFloat16",  "ncclFloat32",
		"ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2",
	};
	return (unsigned)dt < ncclNumTypes ? names[dt] : "Unknown";
}

/* every collective / p2p: the host part of the call, then its kernel */
static void gpu_work(struct ncclComm *c, cudaStream_t stream, const char *func, size_t count,
		     ncclDataType_t dt, int root_or_peer, int p2p)
{
	uint64_t until;
	void *ev = NULL;
	int self = p2p && root_or_peer == c->rank;

	if (c->prof && (p2p || c->nranks > 1)) {
		union sg_nccl_prof_descr_u u;

		memset(&u, 0, sizeof(u));
		if (p2p) {
			u.p2p.func = func;
			u.p2p.datatype = dt_name(dt);
			u.p2p.count = count;
			u.p2p.peer = root_or_peer;
			/* grouped p2p: host events only in this fake, see below */
			u.p2p.nChannels = group_depth_tls() > 0 ? 0 : 1;
		} else {
			u.coll.seqNumber = c->coll_seq++;
			u.coll.func = func;
			u.coll.count = count;
			u.coll.root = root_or_peer;
			u.coll.datatype = dt_name(dt);
			u.coll.nChannels = PROF_CHANNELS;
			u.coll.algo = "Ring";
			u.coll.proto = "Simple";
		}
		ev = prof_start(c->prof, p2p ? ncclProfileP2p : ncclProfileColl, NULL, c->rank, &u);
	}
	until = mono_ns() + enqueue_ns;
	while (enqueue_ns && mono_ns() < until)
		;
	if (ev && (group_depth_tls() > 0 || self)) {
		/* grouped work: host events only in this fake; to oneself: no
		 * kernel channel or proxy events in NCCL either */
		prof_stop(ev);
		ev = NULL;
	}
	if (ev) {
		launch_fn launch = cuda_launch();
		struct prof_kernel_arg *a = calloc(1, sizeof(*a));

		if (a && launch) {
			a->ctx = c->prof;
			a->coll = ev;
			a->rank = c->rank;
			a->nranks = c->nranks;
			a->channels = p2p ? 1 : PROF_CHANNELS;
			a->p2p_peer = p2p ? root_or_peer : -1;
			a->p2p_send = p2p && strcmp(func, "Send") == 0;
			a->late = atomic_load(&c->late) ? c : NULL;
			if (!p2p && c->clique && (a->wait = malloc(sizeof(*a->wait)))) {
				a->wait->clique = c->clique;
				a->wait->rank = c->rank;
				a->wait->nranks = c->nranks;
				a->wait->seq = atomic_fetch_add(&c->seq, 1) + 1;
			}
			prof_stop(ev); /* enqueued */
			if (launch(stream, 0, prof_kernel, a) != 0) {
				free(a->wait);
				free(a);
			}
			return;
		}
		free(a);
		prof_stop(ev);
		return;
	}
	if (group_depth_tls() > 0) {
		if (!group_launch) {
			group_launch = 1;
			group_stream = stream;
			group_comm = c;
			group_kernel_ns = 0;
		}
		group_kernel_ns += kernel_ns;
		return;
	}
	launch_now(c, stream, kernel_ns);
}

enum {
	F_ALLREDUCE, F_ALLGATHER, F_REDUCESCATTER, F_BROADCAST, F_BCAST, F_REDUCE, F_ALLTOALL,
	F_SEND, F_RECV, F_GROUPSTART, F_GROUPEND, F_INITRANK, F_INITCONFIG, F_INITALL, F_SPLIT,
	F_DESTROY, F_ABORT, F_NFUNCS
};

static const char *const fnames[F_NFUNCS] = {
	"ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclBcast",
	"ncclReduce", "ncclAllToAll", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
	"ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitAll", "ncclCommSplit",
	"ncclCommDestroy", "ncclCommAbort",
};

static unsigned long long calls[F_NFUNCS];
static unsigned long long elements[F_NFUNCS];
static __thread int group_depth; /* NCCL groups are per thread */

static int group_depth_tls(void)
{
	return group_depth;
}

/* Test-only: calls and total count argument seen by entry point `name`. */
unsigned long long fakeNcclCalls(const char *name, unsigned long long *elems)
{
	int i;

	for (i = 0; i < F_NFUNCS; i++) {
		if (strcmp(name, fnames[i]) == 0) {
			if (elems)
				*elems = elements[i];
			return calls[i];
		}
	}
	return 0;
}

int fakeNcclGroupDepth(void)
{
	return group_depth;
}

static inline void count_call(int f, size_t n)
{
	calls[f]++;
	elements[f] += n;
}

static size_t dt_size(ncclDataType_t dt)
{
	static const size_t sizes[ncclNumTypes] = { 1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1 };

	return (unsigned)dt < ncclNumTypes ? sizes[dt] : 0;
}

static int valid_comm(ncclComm_t c)
{
	return c && c->nranks > 0 && c->rank >= 0 && c->rank < c->nranks;
}

/* dst[i] = op over nranks copies of src[i] */
#define REDUCE_LOOP(T)                                                         \
	do {                                                                   \
		const T *s = src;                                              \
		T *d = dst;                                                    \
		for (i = 0; i < count; i++) {                                  \
			T x = s[i], acc = x;                                   \
			if (op == ncclSum)                                     \
				acc = (T)(x * (T)n);                           \
			else if (op == ncclProd)                               \
				for (k = 1; k < n; k++)                        \
					acc = (T)(acc * x);                    \
			d[i] = acc;                                            \
		}                                                              \
	} while (0)

static ncclResult_t reduce_into(void *dst, const void *src, size_t count, ncclDataType_t dt,
				ncclRedOp_t op, int n)
{
	size_t i;
	int k;

	if ((unsigned)op >= ncclNumOps)
		return ncclInvalidArgument;
	switch (dt) {
	case ncclInt8:
		REDUCE_LOOP(int8_t);
		break;
	case ncclUint8:
		REDUCE_LOOP(uint8_t);
		break;
	case ncclInt32:
		REDUCE_LOOP(int32_t);
		break;
	case ncclUint32:
		REDUCE_LOOP(uint32_t);
		break;
	case ncclInt64:
		REDUCE_LOOP(int64_t);
		break;
	case ncclUint64:
		REDUCE_LOOP(uint64_t);
		break;
	case ncclFloat32:
		REDUCE_LOOP(float);
		break;
	case ncclFloat64:
		REDUCE_LOOP(double);
		break;
	default:
		/* 16/8-bit floats: max, min and avg of equal inputs are the input */
		if (op == ncclSum || op == ncclProd)
			return ncclInvalidArgument;
		memmove(dst, src, count * dt_size(dt));
	}
	return ncclSuccess;
}

ncclResult_t ncclGetVersion(int *version)
{
	if (!version)
		return ncclInvalidArgument;
#ifdef FAKE_NCCL_OLD
	*version = 21805;
#else
	*version = 22805;
#endif
	return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
	static unsigned long long serial;
	unsigned long long s = ++serial;
	pid_t pid = getpid();

	if (!id)
		return ncclInvalidArgument;
	memset(id, 0, sizeof(*id));
	memcpy(id->internal, &pid, sizeof(pid));
	memcpy(id->internal + 8, &s, sizeof(s));
	return ncclSuccess;
}

static ncclResult_t new_comm(ncclComm_t *comm, int nranks, int rank)
{
	struct ncclComm *c;

	if (!comm || nranks < 1 || rank < 0 || rank >= nranks)
		return ncclInvalidArgument;
	c = calloc(1, sizeof(*c));
	if (!c)
		return ncclSystemError;
	c->rank = rank;
	c->nranks = nranks;
	*comm = c;
	return ncclSuccess;
}

/* the file all ranks of one unique id share (never unmapped: kernels in
 * flight may still use it after the communicator is destroyed) */
static void join_clique(struct ncclComm *c, const ncclUniqueId *id)
{
	const char *dir = getenv("FAKE_NCCL_CLIQUE_DIR");
	unsigned long long h = 0xcbf29ce484222325ull;
	char path[4096];
	size_t i;
	void *m;
	int fd;

	if (!dir || c->nranks > CLIQUE_MAX)
		return;
	for (i = 0; i < sizeof(id->internal); i++)
		h = (h ^ (unsigned char)id->internal[i]) * 0x100000001b3ull;
	snprintf(path, sizeof(path), "%s/clique-%016llx", dir, h);
	fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return;
	if (ftruncate(fd, sizeof(struct clique)) == 0) {
		m = mmap(NULL, sizeof(struct clique), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (m != MAP_FAILED)
			c->clique = m;
	}
	close(fd);
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
	ncclResult_t rc;

	count_call(F_INITRANK, 0);
	rc = new_comm(comm, nranks, rank);
	if (rc == ncclSuccess) {
		join_clique(*comm, &commId);
		prof_init(*comm, comm_hash(&commId));
	}
	return rc;
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist)
{
	int i;

	(void)devlist;
	count_call(F_INITALL, 0);
	if (!comms || ndev < 1)
		return ncclInvalidArgument;
	for (i = 0; i < ndev; i++) {
		ncclResult_t rc = new_comm(&comms[i], ndev, i);

		if (rc != ncclSuccess)
			return rc;
	}
	return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
	if (!valid_comm(comm) || !count)
		return ncclInvalidArgument;
	*count = comm->nranks;
	return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
	if (!valid_comm(comm) || !rank)
		return ncclInvalidArgument;
	*rank = comm->rank;
	return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
	count_call(F_DESTROY, 0);
	if (!comm)
		return ncclInvalidArgument;
	prof_finalize(comm);
	free(comm);
	return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
	count_call(F_ABORT, 0);
	if (!comm)
		return ncclInvalidArgument;
	prof_finalize(comm);
	free(comm);
	return ncclSuccess;
}

#ifndef FAKE_NCCL_OLD
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
				    ncclConfig_t *config)
{
	ncclResult_t rc;

	(void)config;
	count_call(F_INITCONFIG, 0);
	rc = new_comm(comm, nranks, rank);
	if (rc == ncclSuccess)
		prof_init(*comm, comm_hash(&commId));
	return rc;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
			   ncclConfig_t *config)
{
	(void)key;
	(void)config;
	count_call(F_SPLIT, 0);
	if (!valid_comm(comm) || !newcomm)
		return ncclInvalidArgument;
	if (color == NCCL_SPLIT_NOCOLOR) {
		*newcomm = NULL;
		return ncclSuccess;
	}
	return new_comm(newcomm, comm->nranks, comm->rank);
}
#endif

ncclResult_t ncclGroupStart(void)
{
	count_call(F_GROUPSTART, 0);
	group_depth++;
	return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
	count_call(F_GROUPEND, 0);
	if (group_depth == 0)
		return ncclInvalidUsage;
	group_depth--;
	if (group_depth == 0 && group_launch) {
		/* NCCL launches a group's work here, not at the calls */
		group_launch = 0;
		launch_now(group_comm, group_stream, group_kernel_ns);
	}
	return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
			   ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
			   cudaStream_t stream)
{
	count_call(F_ALLREDUCE, count);
	if (!valid_comm(comm) || !dt_size(datatype))
		return ncclInvalidArgument;
	gpu_work(comm, stream, "AllReduce", count, datatype, -1, 0);
	return reduce_into(recvbuff, sendbuff, count, datatype, op, comm->nranks);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
			       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
			       cudaStream_t stream)
{
	count_call(F_REDUCESCATTER, recvcount);
	if (!valid_comm(comm) || !dt_size(datatype))
		return ncclInvalidArgument;
	gpu_work(comm, stream, "ReduceScatter", recvcount, datatype, -1, 0);
	return reduce_into(recvbuff,
			   (const char *)sendbuff + (size_t)comm->rank * recvcount * dt_size(datatype),
			   recvcount, datatype, op, comm->nranks);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
			   ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
	size_t bytes = sendcount * dt_size(datatype);
	int r;

	count_call(F_ALLGATHER, sendcount);
	if (!valid_comm(comm) || !dt_size(datatype))
		return ncclInvalidArgument;
	gpu_work(comm, stream, "AllGather", sendcount, datatype, -1, 0);
	for (r = 0; r < comm->nranks; r++)
		memmove((char *)recvbuff + (size_t)r * bytes, sendbuff, bytes);
	return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
			   ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
	count_call(F_BROADCAST, count);
	if (!valid_comm(comm) || !dt_size(datatype) || root < 0 || root >= comm->nranks)
		return ncclInvalidArgument;
	gpu_work(comm, stream, "Broadcast", count, datatype, root, 0);
	memmove(recvbuff, sendbuff, count * dt_size(datatype));
	return ncclSuccess;
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
		       ncclComm_t comm, cudaStream_t stream)
{
	count_call(F_BCAST, count);
	/* as in NCCL: the legacy call goes through the public ncclBroadcast */
	return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
			ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
			cudaStream_t stream)
{
	count_call(F_REDUCE, count);
	if (!valid_comm(comm) || !dt_size(datatype) || root < 0 || root >= comm->nranks)
		return ncclInvalidArgument;
	gpu_work(comm, stream, "Reduce", count, datatype, root, 0);
	if (comm->rank != root)
		return ncclSuccess;
	return reduce_into(recvbuff, sendbuff, count, datatype, op, comm->nranks);
}

#ifndef FAKE_NCCL_OLD
ncclResult_t ncclAllToAll(const void *sendbuff, void *recvbuff, size_t count,
			  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
	size_t bytes = count * dt_size(datatype);
	int r;

	count_call(F_ALLTOALL, count);
	if (!valid_comm(comm) || !dt_size(datatype))
		return ncclInvalidArgument;
	gpu_work(comm, stream, "AllToAll", count, datatype, -1, 0);
	/* every peer sends us its block number `rank` of an identical buffer */
	for (r = 0; r < comm->nranks; r++)
		memmove((char *)recvbuff + (size_t)r * bytes,
			(const char *)sendbuff + (size_t)comm->rank * bytes, bytes);
	return ncclSuccess;
}
#endif

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
		      ncclComm_t comm, cudaStream_t stream)
{
	(void)sendbuff;
	count_call(F_SEND, count);
	if (!valid_comm(comm) || !dt_size(datatype) || peer < 0 || peer >= comm->nranks)
		return ncclInvalidArgument;
	gpu_work(comm, stream, "Send", count, datatype, peer, 1);
	return ncclSuccess;
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
		      ncclComm_t comm, cudaStream_t stream)
{
	count_call(F_RECV, count);
	if (!valid_comm(comm) || !dt_size(datatype) || peer < 0 || peer >= comm->nranks)
		return ncclInvalidArgument;
	gpu_work(comm, stream, "Recv", count, datatype, peer, 1);
	memset(recvbuff, peer + 1, count * dt_size(datatype));
	return ncclSuccess;
}
