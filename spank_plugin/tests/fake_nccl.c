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
	uint64_t seq;
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
	int r;

	atomic_store(&a->clique->arrived[a->rank], a->seq);
	for (r = 0; r < a->nranks && mono_ns() < limit; r++)
		while (atomic_load(&a->clique->arrived[r]) < a->seq && mono_ns() < limit)
			nanosleep(&nap, NULL);
	free(a);
}

static void launch_now(struct ncclComm *c, cudaStream_t stream, uint64_t ns)
{
	static launch_fn launch;
	struct wait_arg *a = NULL;

	if (!launch)
		launch = (launch_fn)dlsym(RTLD_DEFAULT, "fakeCudaLaunch");
	if (!launch)
		return;
	if (c && c->clique && (a = malloc(sizeof(*a)))) {
		a->clique = c->clique;
		a->rank = c->rank;
		a->nranks = c->nranks;
		a->seq = ++c->seq;
	}
	if (launch(stream, ns, a ? clique_wait : NULL, a) != 0)
		free(a);
}

/* every collective / p2p: the host part of the call, then its kernel */
static void gpu_work(struct ncclComm *c, cudaStream_t stream)
{
	uint64_t until = mono_ns() + enqueue_ns;

	while (enqueue_ns && mono_ns() < until)
		;
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
	if (rc == ncclSuccess)
		join_clique(*comm, &commId);
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
	free(comm);
	return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
	count_call(F_ABORT, 0);
	if (!comm)
		return ncclInvalidArgument;
	free(comm);
	return ncclSuccess;
}

#ifndef FAKE_NCCL_OLD
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
				    ncclConfig_t *config)
{
	(void)commId;
	(void)config;
	count_call(F_INITCONFIG, 0);
	return new_comm(comm, nranks, rank);
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
	gpu_work(comm, stream);
	return reduce_into(recvbuff, sendbuff, count, datatype, op, comm->nranks);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
			       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
			       cudaStream_t stream)
{
	count_call(F_REDUCESCATTER, recvcount);
	if (!valid_comm(comm) || !dt_size(datatype))
		return ncclInvalidArgument;
	gpu_work(comm, stream);
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
	gpu_work(comm, stream);
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
	gpu_work(comm, stream);
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
	gpu_work(comm, stream);
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
	gpu_work(comm, stream);
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
	gpu_work(comm, stream);
	return ncclSuccess;
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
		      ncclComm_t comm, cudaStream_t stream)
{
	count_call(F_RECV, count);
	if (!valid_comm(comm) || !dt_size(datatype) || peer < 0 || peer >= comm->nranks)
		return ncclInvalidArgument;
	gpu_work(comm, stream);
	memset(recvbuff, peer + 1, count * dt_size(datatype));
	return ncclSuccess;
}
