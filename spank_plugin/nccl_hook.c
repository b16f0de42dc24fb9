/*
 * nccl_hook.c - LD_PRELOAD monitor for NCCL (Greyhound 4.2).
 *
 * Each intercepted call is forwarded unchanged to the real library found
 * with dlsym(RTLD_NEXT) (or, when NCCL was loaded with RTLD_LOCAL, through
 * a handle to the already loaded libnccl.so.2), and one record with host
 * entry/return timestamps is appended to this rank's ring. Arguments,
 * results, return codes and errno are never changed.
 *
 * GPU time (gpu_timing.c): collectives and p2p calls outside a group, and
 * each outermost ncclGroupStart/End group as a whole, also get CUDA events
 * on their stream; their record is committed by the completion thread once
 * the work has run on the GPU, with gpu_start_ns/gpu_end_ns. Calls inside
 * a group only enqueue at ncclGroupEnd, so they carry host times and
 * SG_F_IN_GROUP; the group_end record carries the group's GPU time.
 *
 * When the NCCL profiler plugin (nccl_profiler.c) is active in the same
 * process it calls slurmguard_hook_defer() and the hook stops recording:
 * one writer per call.
 *
 * The hook does nothing until the first NCCL call, and only records when
 * SLURMGUARD_RING_DIR is set (the SPANK plugin sets it for guarded jobs).
 * A missing ring, a full /dev/shm or a missing NCCL symbol turns recording
 * off or makes that one call fail as "library not available"; it never
 * crashes or blocks the process.
 *
 * Hold (Greyhound 4.3): when the controller sets SG_CTL_HOLD in the ring
 * header, the next collective or p2p call of this rank waits (1 ms polls)
 * until the bit is cleared or hold_timeout_ms passes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpu_timing.h"
#include "nccl_api.h"
#include "sg_clock.h"
#include "sg_ring.h"
#include "sg_ring_file.h"
#include "sg_sym.h"

#define SG_TLS __thread __attribute__((tls_model("initial-exec")))
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

struct thread_state {
	/* set while this thread is inside the hook: calls NCCL makes to its
	 * own public entry points (ncclBcast -> ncclBroadcast) are forwarded only */
	int busy;
	/* ncclGroupStart nesting depth (NCCL groups are per thread) */
	int group;
	/* the last communicator this thread used, its id and flags, valid
	 * while no communicator was created or destroyed since (last_gen) */
	ncclComm_t last_comm;
	uint64_t last_id;
	uint32_t last_flags;
	uint32_t last_gen;
	/* record numbers this thread reserved in blk_ring: [blk_next, blk_end) */
	struct sg_ring_header *blk_ring;
	uint64_t blk_next, blk_end;
	/* the stream of the first call in the current group: the group's
	 * events go there (NCCL launches a group's work at ncclGroupEnd) */
	cudaStream_t group_stream;
	int group_has_stream;
};

static SG_TLS struct thread_state tls;
#define tls_busy (tls.busy)
#define tls_group (tls.group)

/* set by the NCCL profiler plugin once NCCL loaded it: it records the calls
 * from then on, the hook only forwards them */
static _Atomic int g_defer;

__attribute__((visibility("default"))) void slurmguard_hook_defer(void)
{
	atomic_store(&g_defer, 1);
}

/* reservation mode, see reserve() */
static _Atomic uintptr_t g_block_owner; /* &tls of the thread using blocks */
static _Atomic int g_many_writers;

/* bumped whenever a handle is registered or destroyed, in any thread */
static _Atomic uint32_t g_comm_gen = 1;

static inline void comm_forget_cached(ncclComm_t comm)
{
	(void)comm;
	atomic_fetch_add_explicit(&g_comm_gen, 1, memory_order_release);
}

enum { RING_IDLE = 0, RING_CREATING = 1, RING_READY = 2, RING_OFF = 3 };
static _Atomic(struct sg_ring_header *) g_ring;
static _Atomic int g_ring_state;

static struct sg_clock g_clock;

static inline uint64_t now_ns(void)
{
	return sg_clock_now(&g_clock);
}

/* ------------------------------------------------------------------ symbols */

static void *lookup_real(const char *name, void *self)
{
	static const char *const libs[] = { "libnccl.so.2", "libnccl.so", NULL };

	/* NCCL loaded RTLD_LOCAL (e.g. as a dependency of a dlopen'ed
	 * framework library) is not in the global scope RTLD_NEXT searches */
	return sg_sym_loaded(name, RTLD_NEXT, "SLURMGUARD_NCCL_LIBRARY", libs, self);
}

/* The real function, cached after the first successful lookup. A missing
 * symbol is looked up again next time: NCCL may be dlopen'ed later. */
static inline void *real_fn(_Atomic(void *) *cache, const char *name, void *self)
{
	void *p = atomic_load_explicit(cache, memory_order_relaxed);

	if (likely(p != NULL))
		return p;
	p = lookup_real(name, self);
	if (p)
		atomic_store_explicit(cache, p, memory_order_relaxed);
	return p;
}

#define REAL(type, name)                                                       \
	static _Atomic(void *) real_cache_;                                    \
	type fn = (type)real_fn(&real_cache_, #name, (void *)name)

/* ------------------------------------------------------------------ ring */

static struct sg_ring_header *ring_create(int rank_hint, int size_hint)
{
	return sg_ring_create_for_rank("nccl", SG_SOURCE_NCCL, rank_hint, size_hint);
}

static struct sg_ring_header *ring_slow(int rank_hint, int size_hint)
{
	int expected = RING_IDLE;
	struct sg_ring_header *h;
	int saved = errno;

	if (!atomic_compare_exchange_strong(&g_ring_state, &expected, RING_CREATING))
		return atomic_load_explicit(&g_ring, memory_order_acquire);
	if (atomic_load(&g_clock.mode) == 0)
		sg_clock_setup(&g_clock);
	h = ring_create(rank_hint, size_hint);
	atomic_store_explicit(&g_ring, h, memory_order_release);
	atomic_store(&g_ring_state, h ? RING_READY : RING_OFF);
	errno = saved;
	return h;
}

static inline struct sg_ring_header *ring_get(void)
{
	struct sg_ring_header *h = atomic_load_explicit(&g_ring, memory_order_acquire);

	if (likely(h != NULL))
		return h;
	if (atomic_load_explicit(&g_ring_state, memory_order_relaxed) != RING_IDLE)
		return NULL;
	return ring_slow(-1, 0);
}

static void after_fork_child(void)
{
	/* the child must not write into its parent's ring under the parent's
	 * rank; it gets its own ring if it ever calls NCCL */
	atomic_store(&g_ring, NULL);
	atomic_store(&g_ring_state, RING_IDLE);
	atomic_store(&g_block_owner, 0);
	atomic_store(&g_many_writers, 0);
	memset(&tls, 0, sizeof(tls));
	sg_gpu_after_fork();
}

__attribute__((constructor)) static void hook_init(void)
{
	pthread_atfork(NULL, NULL, after_fork_child);
}

/* ------------------------------------------------------------------ communicators */

#define COMM_SLOTS 1024u
#define COMM_PROBES 16u

struct comm_slot {
	_Atomic uintptr_t key;
	_Atomic uint64_t id; /* 0 until the slot's fields are written */
	int32_t rank;
	int32_t nranks;
	uint32_t flags;
};

static struct comm_slot g_comms[COMM_SLOTS];

static inline uint32_t comm_hash(uintptr_t key)
{
	return (uint32_t)(((uint64_t)key * 0x9e3779b97f4a7c15ull) >> 54) & (COMM_SLOTS - 1);
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t len)
{
	const unsigned char *p = data;
	size_t i;

	for (i = 0; i < len; i++) {
		h ^= p[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

#define FNV_BASIS 0xcbf29ce484222325ull

/* never 0: 0 marks "no communicator" in records */
static inline uint64_t nonzero(uint64_t id)
{
	return id ? id : 1;
}

static void comm_remember(ncclComm_t comm, uint64_t id, int rank, int nranks, uint32_t flags)
{
	uintptr_t key = (uintptr_t)comm;
	uint32_t i, idx = comm_hash(key);

	if (!comm)
		return;
	comm_forget_cached(comm);
	for (i = 0; i < COMM_PROBES; i++) {
		struct comm_slot *s = &g_comms[(idx + i) & (COMM_SLOTS - 1)];
		uintptr_t k = atomic_load_explicit(&s->key, memory_order_acquire);

		if (k == 0) {
			uintptr_t zero = 0;

			if (!atomic_compare_exchange_strong(&s->key, &zero, key)) {
				if (zero != key)
					continue;
			}
			k = key;
		}
		if (k == key) {
			/* a destroyed communicator's address may be reused */
			atomic_store_explicit(&s->id, 0, memory_order_relaxed);
			s->rank = rank;
			s->nranks = nranks;
			s->flags = flags;
			atomic_store_explicit(&s->id, nonzero(id), memory_order_release);
			return;
		}
	}
	/* table full: records of this communicator carry its handle hash */
}

static inline struct comm_slot *comm_find(ncclComm_t comm)
{
	uintptr_t key = (uintptr_t)comm;
	uint32_t i, idx = comm_hash(key);

	for (i = 0; i < COMM_PROBES; i++) {
		struct comm_slot *s = &g_comms[(idx + i) & (COMM_SLOTS - 1)];
		uintptr_t k = atomic_load_explicit(&s->key, memory_order_acquire);

		if (likely(k == key))
			return atomic_load_explicit(&s->id, memory_order_acquire) ? s : NULL;
		if (k == 0)
			return NULL;
	}
	return NULL;
}

typedef ncclResult_t (*comm_int_fn)(const ncclComm_t, int *);

/* A communicator created before the hook saw it (or by an init call the
 * hook does not know): learn rank and size from NCCL, id from the handle. */
static uint64_t comm_learn(ncclComm_t comm, uint32_t *flags)
{
	static _Atomic(void *) c_rank, c_count;
	comm_int_fn user_rank = (comm_int_fn)real_fn(&c_rank, "ncclCommUserRank", NULL);
	comm_int_fn count = (comm_int_fn)real_fn(&c_count, "ncclCommCount", NULL);
	uintptr_t key = (uintptr_t)comm;
	int rank = -1, n = 0;
	uint64_t id;

	if (!comm)
		return 0;
	if (user_rank && user_rank(comm, &rank) != ncclSuccess)
		rank = -1;
	if (count && count(comm, &n) != ncclSuccess)
		n = 0;
	id = nonzero(fnv1a(fnv1a(FNV_BASIS, &key, sizeof(key)), &(uint32_t){ (uint32_t)getpid() },
			   sizeof(uint32_t)));
	comm_remember(comm, id, rank, n, SG_F_COMM_UNKNOWN);
	*flags |= SG_F_COMM_UNKNOWN;
	return id;
}

static inline uint64_t comm_id(ncclComm_t comm, uint32_t *flags)
{
	struct comm_slot *s;
	uint64_t id;

	uint32_t gen = atomic_load_explicit(&g_comm_gen, memory_order_acquire);

	if (likely(comm == tls.last_comm && gen == tls.last_gen)) {
		*flags |= tls.last_flags;
		return tls.last_id;
	}
	s = comm_find(comm);
	if (likely(s != NULL)) {
		id = atomic_load_explicit(&s->id, memory_order_relaxed);
		tls.last_flags = s->flags;
	} else {
		uint32_t learned = 0;

		id = comm_learn(comm, &learned);
		tls.last_flags = learned;
	}
	tls.last_comm = comm;
	tls.last_id = id;
	tls.last_gen = gen;
	*flags |= tls.last_flags;
	return id;
}


/* ------------------------------------------------------------------ records */

static inline uint8_t map_datatype(ncclDataType_t dt)
{
	static const uint8_t map[ncclNumTypes] = {
		SG_DT_INT8,    SG_DT_UINT8,   SG_DT_INT32,    SG_DT_UINT32,
		SG_DT_INT64,   SG_DT_UINT64,  SG_DT_FLOAT16,  SG_DT_FLOAT32,
		SG_DT_FLOAT64, SG_DT_BFLOAT16, SG_DT_FP8E4M3, SG_DT_FP8E5M2,
	};
	return (unsigned)dt < ncclNumTypes ? map[dt] : SG_DT_UNKNOWN;
}

static inline uint8_t map_redop(int op)
{
	return (unsigned)op < (unsigned)ncclNumOps ? (uint8_t)(op + 1) : SG_REDOP_OTHER;
}

/*
 * Record numbers. While one thread issues all NCCL calls (the usual case)
 * it reserves SG_RING_BLOCK numbers with one atomic add and uses them one
 * by one (see "Block reservation" in sg_ring.h): one locked instruction per
 * block instead of per call. Once a second thread records, every thread
 * reserves one number per record, and the first thread pads the rest of
 * its block with SG_OP_NONE records so no hole is left for readers to wait
 * on.
 */
static inline struct sg_record *slot_of(struct sg_ring_header *h, uint64_t i)
{
	struct sg_record *s = sg_ring_slots(h) + (i & (h->capacity - 1));

	atomic_store_explicit(&s->seq, 0, memory_order_relaxed);
	atomic_thread_fence(memory_order_release);
	return s;
}

static void __attribute__((noinline)) pad_block(struct sg_ring_header *h)
{
	while (tls.blk_next < tls.blk_end) {
		uint64_t i = tls.blk_next++;
		struct sg_record *s = slot_of(h, i);

		memset((char *)s + sizeof(s->seq), 0, sizeof(*s) - sizeof(s->seq));
		s->peer = -1;
		sg_ring_commit(h, s, i);
	}
}

static struct sg_record *__attribute__((noinline)) reserve_slow(struct sg_ring_header *h,
								uint64_t *n)
{
	uintptr_t me = (uintptr_t)&tls, owner = 0;

	if (tls.blk_ring == h && tls.blk_next < tls.blk_end)
		pad_block(h); /* another thread showed up */
	if (!atomic_load(&g_many_writers)) {
		if (!atomic_compare_exchange_strong(&g_block_owner, &owner, me) && owner != me)
			atomic_store(&g_many_writers, 1);
	}
	if (atomic_load(&g_many_writers) ||
	    atomic_load(&g_block_owner) != me || h->capacity < 256) {
		uint64_t i = atomic_fetch_add_explicit(&h->write_counter, 1, memory_order_relaxed);

		tls.blk_ring = NULL;
		*n = i;
		return slot_of(h, i);
	}
	tls.blk_next = atomic_fetch_add_explicit(&h->write_counter, SG_RING_BLOCK,
						 memory_order_relaxed);
	tls.blk_end = tls.blk_next + SG_RING_BLOCK;
	tls.blk_ring = h;
	*n = tls.blk_next++;
	return slot_of(h, *n);
}

static inline struct sg_record *reserve(struct sg_ring_header *h, uint64_t *n)
{
	if (likely(tls.blk_ring == h && tls.blk_next < tls.blk_end &&
		   !atomic_load_explicit(&g_many_writers, memory_order_relaxed))) {
		*n = tls.blk_next++;
		return slot_of(h, *n);
	}
	return reserve_slow(h, n);
}

/* r0, r1: raw clock readings (sg_clock_raw) around the call; gflags:
 * SG_F_* from sg_gpu_begin; pair >= 0: events in flight, the completion
 * thread commits */
static inline void emit(struct sg_ring_header *h, uint16_t op, ncclComm_t comm, int32_t peer,
			uint64_t count, ncclDataType_t dt, uint8_t redop, uint64_t r0, uint64_t r1,
			ncclResult_t rc, uint32_t gflags, int pair, cudaStream_t stream)
{
	uint32_t flags = (tls_group > 0 ? SG_F_IN_GROUP : 0) | gflags;
	uint8_t sdt = map_datatype(dt);
	uint64_t id = comm ? comm_id(comm, &flags) : 0;
	uint64_t n, t0, t1;
	struct sg_record *s;

	sg_clock_ns2(&g_clock, r0, r1, &t0, &t1);
	s = reserve(h, &n);

	s->comm_id = id;
	s->count = count;
	s->bytes = count * sg_datatype_size(sdt);
	s->start_ns = t0;
	s->end_ns = t1;
	s->peer = peer;
	s->op = op;
	s->datatype = sdt;
	s->redop = redop;
	s->flags = flags | (rc != ncclSuccess ? SG_F_ERROR : 0);
	s->status = (int32_t)rc;
	memset(&s->gpu_start_ns, 0, sizeof(*s) - offsetof(struct sg_record, gpu_start_ns));
	if (pair >= 0)
		sg_gpu_submit(h, s, n, pair, stream);
	else
		sg_ring_commit(h, s, n);
}

static void emit_meta_gpu(struct sg_ring_header *h, uint16_t op, uint64_t id, int32_t rank,
			  uint64_t nranks, uint32_t flags, uint64_t t0, uint64_t t1,
			  ncclResult_t rc, int pair, cudaStream_t stream)
{
	struct sg_record r;

	memset(&r, 0, sizeof(r));
	r.comm_id = id;
	r.count = nranks;
	r.start_ns = t0;
	r.end_ns = t1;
	r.peer = rank;
	r.op = op;
	r.flags = flags | (tls_group > 0 ? SG_F_IN_GROUP : 0) | (rc != ncclSuccess ? SG_F_ERROR : 0);
	r.status = (int32_t)rc;
	{
		uint64_t n;
		struct sg_record *s = reserve(h, &n);

		sg_record_copy_body(s, &r);
		if (pair >= 0)
			sg_gpu_submit(h, s, n, pair, stream);
		else
			sg_ring_commit(h, s, n);
	}
}

static inline void emit_meta(struct sg_ring_header *h, uint16_t op, uint64_t id, int32_t rank,
			     uint64_t nranks, uint32_t flags, uint64_t t0, uint64_t t1,
			     ncclResult_t rc)
{
	emit_meta_gpu(h, op, id, rank, nranks, flags, t0, t1, rc, -1, NULL);
}

static void __attribute__((noinline)) hold_wait(struct sg_ring_header *h)
{
	uint64_t t0, t1;
	uint32_t flags;
	int saved = errno;

	flags = sg_ring_hold(h, &t0, &t1);
	emit_meta(h, SG_OP_HOLD, 0, -1, 0, flags, t0, t1, ncclSuccess);
	errno = saved;
}

static inline void hold_point(struct sg_ring_header *h)
{
	if (unlikely(atomic_load_explicit(&h->control, memory_order_relaxed) & SG_CTL_HOLD))
		hold_wait(h);
}

static inline int deferred(void)
{
	return atomic_load_explicit(&g_defer, memory_order_relaxed);
}

/*
 * Body shared by every collective and p2p wrapper: forward only when NCCL
 * is missing, re-entered, or recording is off (or the profiler plugin
 * records); otherwise hold point, start event, host timestamps around the
 * real call (not around the event records), end event, one record.
 */
#define TIMED_CALL(OP, COMM, PEER, COUNT, DT, REDOP, STREAM, CALL)             \
	do {                                                                   \
		struct sg_ring_header *h_;                                     \
		uint64_t t0_, t1_;                                             \
		ncclResult_t rc_;                                              \
		uint32_t gf_ = 0;                                              \
		int pair_ = -1;                                                \
		if (unlikely(!fn))                                             \
			return ncclSystemError;                                \
		if (unlikely(tls_busy) || unlikely(deferred()) ||              \
		    unlikely(!(h_ = ring_get())))                              \
			return CALL;                                           \
		tls_busy = 1;                                                  \
		hold_point(h_);                                                \
		if (tls_group > 0) {                                           \
			if (!tls.group_has_stream) {                           \
				tls.group_stream = (STREAM);                   \
				tls.group_has_stream = 1;                      \
			}                                                      \
		} else {                                                       \
			gf_ = sg_gpu_begin(h_, (STREAM), &pair_);              \
		}                                                              \
		t0_ = sg_clock_raw(&g_clock);                                  \
		rc_ = CALL;                                                    \
		t1_ = sg_clock_raw(&g_clock);                                  \
		if (pair_ >= 0 && sg_gpu_end(pair_, (STREAM)) != 0) {          \
			pair_ = -1;                                            \
			gf_ |= SG_F_NO_EVENT;                                  \
		}                                                              \
		emit(h_, OP, COMM, PEER, COUNT, DT, REDOP, t0_, t1_, rc_, gf_, \
		     pair_, (STREAM));                                         \
		tls_busy = 0;                                                  \
		return rc_;                                                    \
	} while (0)

/* ------------------------------------------------------------------ collectives */

typedef ncclResult_t (*allreduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
				     ncclComm_t, cudaStream_t);
typedef ncclResult_t (*bcast_fn)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*broadcast_fn)(const void *, void *, size_t, ncclDataType_t, int,
				     ncclComm_t, cudaStream_t);
typedef ncclResult_t (*reduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int,
				  ncclComm_t, cudaStream_t);
typedef ncclResult_t (*allgather_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
				     cudaStream_t);
typedef ncclResult_t (*send_fn)(const void *, size_t, ncclDataType_t, int, ncclComm_t,
				cudaStream_t);
typedef ncclResult_t (*recv_fn)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*void_fn)(void);

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
			   ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
			   cudaStream_t stream)
{
	REAL(allreduce_fn, ncclAllReduce);
	TIMED_CALL(SG_OP_ALLREDUCE, comm, -1, count, datatype, map_redop(op), stream,
		   fn(sendbuff, recvbuff, count, datatype, op, comm, stream));
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
			       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
			       cudaStream_t stream)
{
	REAL(allreduce_fn, ncclReduceScatter);
	TIMED_CALL(SG_OP_REDUCESCATTER, comm, -1, recvcount, datatype, map_redop(op), stream,
		   fn(sendbuff, recvbuff, recvcount, datatype, op, comm, stream));
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
			   ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
	REAL(allgather_fn, ncclAllGather);
	TIMED_CALL(SG_OP_ALLGATHER, comm, -1, sendcount, datatype, SG_REDOP_NONE, stream,
		   fn(sendbuff, recvbuff, sendcount, datatype, comm, stream));
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
			   ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
	REAL(broadcast_fn, ncclBroadcast);
	TIMED_CALL(SG_OP_BROADCAST, comm, root, count, datatype, SG_REDOP_NONE, stream,
		   fn(sendbuff, recvbuff, count, datatype, root, comm, stream));
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
		       ncclComm_t comm, cudaStream_t stream)
{
	REAL(bcast_fn, ncclBcast);
	TIMED_CALL(SG_OP_BROADCAST, comm, root, count, datatype, SG_REDOP_NONE, stream,
		   fn(buff, count, datatype, root, comm, stream));
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
			ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
			cudaStream_t stream)
{
	REAL(reduce_fn, ncclReduce);
	TIMED_CALL(SG_OP_REDUCE, comm, root, count, datatype, map_redop(op), stream,
		   fn(sendbuff, recvbuff, count, datatype, op, root, comm, stream));
}

/* All-to-all is in NCCL only from 2.28 (both spellings appear in NCCL-API
 * libraries). Against an older library the lookup fails and the call
 * reports ncclSystemError; programs built against such a library cannot
 * reference the symbol in the first place. */
ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count,
			  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
	REAL(allgather_fn, ncclAlltoAll);
	TIMED_CALL(SG_OP_ALLTOALL, comm, -1, count, datatype, SG_REDOP_NONE, stream,
		   fn(sendbuff, recvbuff, count, datatype, comm, stream));
}

ncclResult_t ncclAllToAll(const void *sendbuff, void *recvbuff, size_t count,
			  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
	REAL(allgather_fn, ncclAllToAll);
	TIMED_CALL(SG_OP_ALLTOALL, comm, -1, count, datatype, SG_REDOP_NONE, stream,
		   fn(sendbuff, recvbuff, count, datatype, comm, stream));
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
		      ncclComm_t comm, cudaStream_t stream)
{
	REAL(send_fn, ncclSend);
	TIMED_CALL(SG_OP_SEND, comm, peer, count, datatype, SG_REDOP_NONE, stream,
		   fn(sendbuff, count, datatype, peer, comm, stream));
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
		      ncclComm_t comm, cudaStream_t stream)
{
	REAL(recv_fn, ncclRecv);
	TIMED_CALL(SG_OP_RECV, comm, peer, count, datatype, SG_REDOP_NONE, stream,
		   fn(recvbuff, count, datatype, peer, comm, stream));
}

/* ------------------------------------------------------------------ groups */

static ncclResult_t group_call(void_fn fn, uint16_t op, int delta)
{
	struct sg_ring_header *h;
	cudaStream_t stream = NULL;
	uint32_t gflags = 0;
	int pair = -1, outermost;
	uint64_t t0, t1;
	ncclResult_t rc;

	if (unlikely(!fn))
		return ncclSystemError;
	if (tls_busy)
		return fn();
	/* the depth tracks the caller's view, whatever the call returns */
	if (delta < 0 && tls_group > 0)
		tls_group += delta;
	outermost = delta < 0 && tls_group == 0 && tls.group_has_stream;
	if (outermost) {
		stream = tls.group_stream;
		tls.group_has_stream = 0;
	}
	h = deferred() ? NULL : ring_get();
	if (!h) {
		rc = fn();
		if (delta > 0)
			tls_group += delta;
		return rc;
	}
	tls_busy = 1;
	if (outermost)
		gflags = sg_gpu_begin(h, stream, &pair);
	t0 = now_ns();
	rc = fn();
	t1 = now_ns();
	if (pair >= 0 && sg_gpu_end(pair, stream) != 0) {
		pair = -1;
		gflags |= SG_F_NO_EVENT;
	}
	emit_meta_gpu(h, op, 0, -1, 0, gflags, t0, t1, rc, pair, stream);
	if (delta > 0)
		tls_group += delta;
	tls_busy = 0;
	return rc;
}

ncclResult_t ncclGroupStart(void)
{
	REAL(void_fn, ncclGroupStart);
	return group_call(fn, SG_OP_GROUP_START, +1);
}

ncclResult_t ncclGroupEnd(void)
{
	REAL(void_fn, ncclGroupEnd);
	return group_call(fn, SG_OP_GROUP_END, -1);
}

/* ------------------------------------------------------------------ communicators */

typedef ncclResult_t (*init_rank_fn)(ncclComm_t *, int, ncclUniqueId, int);
typedef ncclResult_t (*init_rank_config_fn)(ncclComm_t *, int, ncclUniqueId, int,
					    ncclConfig_t *);
typedef ncclResult_t (*init_all_fn)(ncclComm_t *, int, const int *);
typedef ncclResult_t (*init_scalable_fn)(ncclComm_t *, int, int, int, ncclUniqueId *,
					 ncclConfig_t *);
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
typedef ncclResult_t (*comm_fn)(ncclComm_t);

/* the unique id is what all ranks of a communicator share: its hash is a
 * communicator id that the controller can match across ranks and nodes */
static uint64_t unique_id_hash(const ncclUniqueId *id)
{
	return nonzero(fnv1a(FNV_BASIS, id->internal, sizeof(id->internal)));
}

static void init_done(ncclComm_t *newcomm, uint64_t id, int rank, int nranks, uint64_t t0,
		      ncclResult_t rc, struct sg_ring_header *h)
{
	/* with a non-blocking config the call may return ncclInProgress with
	 * the handle already valid */
	if ((rc == ncclSuccess || rc == ncclInProgress) && newcomm && *newcomm)
		comm_remember(*newcomm, id, rank, nranks, 0);
	/* NCCL may have loaded the profiler plugin during this very init */
	if (h && !deferred())
		emit_meta(h, SG_OP_COMM_INIT, id, rank, (uint64_t)nranks, 0, t0, now_ns(), rc);
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
	struct sg_ring_header *h;
	ncclResult_t rc;
	uint64_t t0;

	REAL(init_rank_fn, ncclCommInitRank);
	if (!fn)
		return ncclSystemError;
	if (tls_busy)
		return fn(comm, nranks, commId, rank);
	tls_busy = 1;
	h = atomic_load(&g_ring);
	if (!h && atomic_load(&g_ring_state) == RING_IDLE)
		h = ring_slow(rank, nranks);
	t0 = now_ns();
	rc = fn(comm, nranks, commId, rank);
	init_done(comm, unique_id_hash(&commId), rank, nranks, t0, rc, h);
	tls_busy = 0;
	return rc;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
				    ncclConfig_t *config)
{
	struct sg_ring_header *h;
	ncclResult_t rc;
	uint64_t t0;

	REAL(init_rank_config_fn, ncclCommInitRankConfig);
	if (!fn)
		return ncclSystemError;
	if (tls_busy)
		return fn(comm, nranks, commId, rank, config);
	tls_busy = 1;
	h = atomic_load(&g_ring);
	if (!h && atomic_load(&g_ring_state) == RING_IDLE)
		h = ring_slow(rank, nranks);
	t0 = now_ns();
	rc = fn(comm, nranks, commId, rank, config);
	init_done(comm, unique_id_hash(&commId), rank, nranks, t0, rc, h);
	tls_busy = 0;
	return rc;
}

ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
				      ncclUniqueId *commIds, ncclConfig_t *config)
{
	struct sg_ring_header *h;
	ncclResult_t rc;
	uint64_t t0;

	REAL(init_scalable_fn, ncclCommInitRankScalable);
	if (!fn)
		return ncclSystemError;
	if (tls_busy)
		return fn(newcomm, nranks, myrank, nId, commIds, config);
	tls_busy = 1;
	h = atomic_load(&g_ring);
	if (!h && atomic_load(&g_ring_state) == RING_IDLE)
		h = ring_slow(myrank, nranks);
	t0 = now_ns();
	rc = fn(newcomm, nranks, myrank, nId, commIds, config);
	init_done(newcomm, (nId > 0 && commIds) ? unique_id_hash(&commIds[0]) : 0, myrank, nranks,
		  t0, rc, h);
	tls_busy = 0;
	return rc;
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist)
{
	struct sg_ring_header *h;
	ncclResult_t rc;
	uint64_t t0, id;
	int i;

	REAL(init_all_fn, ncclCommInitAll);
	if (!fn)
		return ncclSystemError;
	if (tls_busy)
		return fn(comms, ndev, devlist);
	tls_busy = 1;
	h = ring_get();
	t0 = now_ns();
	rc = fn(comms, ndev, devlist);
	/* one clique inside this process: any id shared by its comms will do */
	id = nonzero(fnv1a(fnv1a(FNV_BASIS, &t0, sizeof(t0)), &comms, sizeof(comms)));
	for (i = 0; comms && i < ndev; i++)
		init_done(&comms[i], id, i, ndev, t0, rc, h);
	tls_busy = 0;
	return rc;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
			   ncclConfig_t *config)
{
	static _Atomic(void *) c_rank, c_count;
	struct sg_ring_header *h;
	uint32_t flags = 0;
	uint64_t t0, parent, id;
	int rank = -1, n = 0;
	ncclResult_t rc;

	REAL(split_fn, ncclCommSplit);
	if (!fn)
		return ncclSystemError;
	if (tls_busy)
		return fn(comm, color, key, newcomm, config);
	tls_busy = 1;
	h = deferred() ? NULL : ring_get();
	parent = comm ? comm_id(comm, &flags) : 0;
	t0 = now_ns();
	rc = fn(comm, color, key, newcomm, config);
	if ((rc == ncclSuccess || rc == ncclInProgress) && newcomm && *newcomm) {
		comm_int_fn user_rank = (comm_int_fn)real_fn(&c_rank, "ncclCommUserRank", NULL);
		comm_int_fn count = (comm_int_fn)real_fn(&c_count, "ncclCommCount", NULL);

		/* every member of the new communicator has the same parent
		 * and color, so this id matches across them */
		id = nonzero(fnv1a(fnv1a(parent, "split", 5), &color, sizeof(color)));
		if (user_rank && user_rank(*newcomm, &rank) != ncclSuccess)
			rank = -1;
		if (count && count(*newcomm, &n) != ncclSuccess)
			n = 0;
		comm_remember(*newcomm, id, rank, n, flags & SG_F_COMM_UNKNOWN);
		if (h)
			emit_meta(h, SG_OP_COMM_SPLIT, id, rank, (uint64_t)n, flags, t0, now_ns(),
				  rc);
	} else if (h) {
		emit_meta(h, SG_OP_COMM_SPLIT, 0, -1, 0, flags, t0, now_ns(), rc);
	}
	tls_busy = 0;
	return rc;
}

static ncclResult_t comm_end(comm_fn fn, ncclComm_t comm, uint16_t op)
{
	struct sg_ring_header *h;
	uint32_t flags = 0;
	uint64_t t0, id;
	int32_t rank = -1;
	uint64_t n = 0;
	struct comm_slot *s;
	ncclResult_t rc;

	if (!fn)
		return ncclSystemError;
	if (tls_busy || deferred() || !(h = ring_get()))
		return fn(comm);
	tls_busy = 1;
	/* look the communicator up before NCCL frees it */
	s = comm ? comm_find(comm) : NULL;
	if (s) {
		rank = s->rank;
		n = (uint64_t)(s->nranks > 0 ? s->nranks : 0);
		flags = s->flags;
		id = atomic_load(&s->id);
	} else {
		id = comm ? comm_id(comm, &flags) : 0;
	}
	t0 = now_ns();
	rc = fn(comm);
	comm_forget_cached(comm);
	emit_meta(h, op, id, rank, n, flags, t0, now_ns(), rc);
	tls_busy = 0;
	return rc;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
	REAL(comm_fn, ncclCommDestroy);
	return comm_end(fn, comm, SG_OP_COMM_DESTROY);
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
	REAL(comm_fn, ncclCommAbort);
	return comm_end(fn, comm, SG_OP_COMM_ABORT);
}
