/*
 * sg_ring.h - the one definition of slurmguard's per-rank ring file.
 *
 * A ring is a regular file (normally under /dev/shm) that one rank appends
 * fixed-size records to, and the node agent reads while the rank runs.
 *
 *   offset 0                : struct sg_ring_header (SG_RING_HEADER_SIZE bytes)
 *   offset header_size + i*record_size : struct sg_record, slot i,
 *                             i in [0, capacity), capacity a power of two
 *
 * All integers are little-endian (the file never leaves the node).
 *
 * File names: <ring dir>/rank-<global rank>.step-<step>.<source>.ring where
 * <step> is the step id or batch/extern/interactive and <source> is nccl or
 * torch. A name that is taken gets .pid-<pid> before .ring. Readers should
 * trust the header, not the name.
 *
 * Commit protocol (lock-free, multi-writer, readers never block writers):
 *   writer: n = fetch_add(write_counter, 1)
 *           slot = n & (capacity - 1)
 *           store(slot.seq, 0, relaxed); fence(release)   -- "being written"
 *           write the other fields
 *           store(slot.seq, n + 1, release)               -- committed
 *   reader of record n (n < write_counter):
 *           s1 = load(slot.seq, acquire)
 *           s1 == n + 1 -> copy the record, fence(acquire),
 *                          s2 = load(slot.seq); s2 == s1 -> consistent copy,
 *                          otherwise it was overwritten while copying (torn)
 *           s1 <  n + 1 (0 included) -> not committed yet; retry later
 *           s1 >  n + 1 -> overwritten by a newer lap: lost
 * When the ring is full the writer overwrites the oldest slot and stores
 * overwritten = (its record number + 1) - capacity, so the loss is counted.
 *
 * Block reservation: a writer that is the only writer of the ring may
 * reserve SG_RING_BLOCK consecutive numbers with one fetch_add and commit
 * them one by one (the NCCL hook does, to keep the locked instruction off
 * most calls); if another writer appears it commits SG_OP_NONE padding
 * records into the rest of its block and reserves one number at a time.
 * write_counter therefore counts reserved numbers and may run ahead of the
 * newest committed record by up to one block. Readers stop at the first
 * uncommitted record and come back later, skip SG_OP_NONE records
 * silently, and give up on a hole only when records after it are
 * committed and it stays open (its writer died), or when the ring is about
 * to overwrite it.
 *
 * Header fields are written once at creation before magic is stored (with
 * release order); a reader that sees the magic sees a complete header.
 *
 * The control block lets the controller hold a rank at its next collective
 * (Greyhound 4.3 "hang"): set SG_CTL_HOLD in control (optionally
 * hold_timeout_ms first); the writer waits until the bit is cleared or the
 * timeout passes (then it clears the bit itself and counts hold_timeouts).
 *
 * slurmguard/hook/ring.py mirrors this file; tests/test_hook_ring_format.py
 * checks that both agree, field by field.
 */
#ifndef SG_RING_H
#define SG_RING_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define SG_RING_MAGIC        0x3130474e49524753ULL /* "SGRING01" as bytes */
/* 2: 128-byte records with GPU start/end and per-peer transfer aggregates;
 * GPU timing state in the header. Readers reject other versions. */
#define SG_RING_VERSION_NUM  2
#define SG_RING_VERSION      2u
#define SG_STR_(x) #x
#define SG_STR(x) SG_STR_(x)
#define SG_RING_HEADER_SIZE  4096u
#define SG_RING_RECORD_SIZE  128u
#define SG_RING_MIN_CAPACITY 16u
#define SG_RING_MAX_CAPACITY (1u << 24)
#define SG_RING_DEFAULT_CAPACITY 65536u /* 8 MiB of records per rank */
#define SG_NODE_NAME_LEN     64

/* header.source: who writes the ring */
#define SG_SOURCE_NCCL  1u
#define SG_SOURCE_TORCH 2u
#define SG_SOURCE_TEST  3u
#define SG_SOURCE_NCCL_PROFILER 4u /* libslurmguard_nccl_profiler.so; file name "ncclprof" */

/* header.control bits, set by the controller */
#define SG_CTL_HOLD 0x1u
/* hold timeout when header.hold_timeout_ms is 0 (ms) */
#define SG_HOLD_DEFAULT_TIMEOUT_MS 60000u

/* step ids Slurm reserves for special steps (slurm.h) */
#define SG_STEP_INTERACTIVE 0xfffffffaU
#define SG_STEP_PENDING     0xfffffffdU
#define SG_STEP_BATCH       0xfffffffbU
#define SG_STEP_EXTERN      0xfffffffcU

/* record.op; the names are what `slurmguard ring dump` prints */
enum sg_op {
	SG_OP_NONE = 0,          /* none (padding: skip) */
	SG_OP_ALLREDUCE = 1,     /* allreduce */
	SG_OP_ALLGATHER = 2,     /* allgather */
	SG_OP_REDUCESCATTER = 3, /* reducescatter */
	SG_OP_BROADCAST = 4,     /* broadcast */
	SG_OP_REDUCE = 5,        /* reduce */
	SG_OP_ALLTOALL = 6,      /* alltoall */
	SG_OP_SEND = 7,          /* send */
	SG_OP_RECV = 8,          /* recv */
	SG_OP_GROUP_START = 9,   /* group_start */
	SG_OP_GROUP_END = 10,    /* group_end */
	SG_OP_COMM_INIT = 11,    /* comm_init */
	SG_OP_COMM_DESTROY = 12, /* comm_destroy */
	SG_OP_COMM_ABORT = 13,   /* comm_abort */
	SG_OP_BARRIER = 14,      /* barrier */
	SG_OP_GATHER = 15,       /* gather */
	SG_OP_SCATTER = 16,      /* scatter */
	SG_OP_HOLD = 17,         /* hold */
	SG_OP_COMM_SPLIT = 18,   /* comm_split */
	SG_OP_PEER_XFER = 19,    /* peer_xfer (aggregate of proxy steps to one peer) */
	SG_OP_COUNT = 20
};

/* record.datatype (our own numbering, independent of NCCL and torch) */
enum sg_datatype {
	SG_DT_UNKNOWN = 0,   /* unknown */
	SG_DT_INT8 = 1,      /* int8 */
	SG_DT_UINT8 = 2,     /* uint8 */
	SG_DT_INT32 = 3,     /* int32 */
	SG_DT_UINT32 = 4,    /* uint32 */
	SG_DT_INT64 = 5,     /* int64 */
	SG_DT_UINT64 = 6,    /* uint64 */
	SG_DT_FLOAT16 = 7,   /* float16 */
	SG_DT_FLOAT32 = 8,   /* float32 */
	SG_DT_FLOAT64 = 9,   /* float64 */
	SG_DT_BFLOAT16 = 10, /* bfloat16 */
	SG_DT_FP8E4M3 = 11,  /* float8_e4m3 */
	SG_DT_FP8E5M2 = 12,  /* float8_e5m2 */
	SG_DT_BOOL = 13,     /* bool */
	SG_DT_INT16 = 14,    /* int16 */
	SG_DT_UINT16 = 15,   /* uint16 */
	SG_DT_COMPLEX64 = 16,  /* complex64 */
	SG_DT_COMPLEX128 = 17, /* complex128 */
	SG_DT_COUNT = 18
};

/* record.redop */
enum sg_redop {
	SG_REDOP_NONE = 0,   /* none (not a reduction) */
	SG_REDOP_SUM = 1,    /* sum */
	SG_REDOP_PROD = 2,   /* prod */
	SG_REDOP_MAX = 3,    /* max */
	SG_REDOP_MIN = 4,    /* min */
	SG_REDOP_AVG = 5,    /* avg */
	SG_REDOP_OTHER = 6,  /* other (PreMulSum, custom, bitwise) */
	SG_REDOP_COUNT = 7
};

/* record.flags */
#define SG_F_IN_GROUP     0x01u /* issued between GroupStart and GroupEnd */
#define SG_F_ASYNC        0x04u /* end_ns is the completion time of async work */
#define SG_F_COMM_UNKNOWN 0x08u /* communicator not seen at init; id from handle */
#define SG_F_ERROR        0x10u /* status is not success */
#define SG_F_COALESCED    0x20u /* one record for a coalesced list of tensors */
#define SG_F_TIMEOUT      0x40u /* hold record: released by timeout */
#define SG_F_GPU_TIME     0x80u /* gpu_start_ns/gpu_end_ns hold the GPU execution */
#define SG_F_CAPTURED     0x100u /* issued into a CUDA graph capture: runs later, no events */
#define SG_F_NO_EVENT     0x200u /* GPU timing wanted but not available for this call */
#define SG_F_XFER_SEND    0x400u /* peer_xfer: data sent to peer (else received) */

/* header_flags: the writer keeps in_flight and in_flight_since_ns, so a
 * reader can tell a rank between collectives from one blocked inside one.
 * The torch hook sets it at creation; the NCCL hook while its CUDA-event
 * timing is on (a call is in flight until its GPU work has run; with host
 * times only a call is recorded as it returns and nothing would ever read as
 * in flight); the profiler plugin at creation (an operation is in flight
 * until its kernel channels have stopped: a hung collective is one whose
 * kernel never finishes). Readers re-read it. */
#define SG_HF_IN_FLIGHT 0x1u

/* header.gpu_state: CUDA-event / profiler GPU timing of the writer */
#define SG_GPU_UNTRIED    0u /* no timed call yet (or timing not wanted) */
#define SG_GPU_ON         1u /* records carry GPU times (SG_F_GPU_TIME) */
#define SG_GPU_NO_RUNTIME 2u /* no CUDA runtime in the process: host times only */
#define SG_GPU_POOL       3u /* event pool exhausted: off for the rest of the process */
#define SG_GPU_CUDA_ERROR 4u /* a CUDA call failed (gpu_error): off */
#define SG_GPU_DISABLED   5u /* SLURMGUARD_CUDA_EVENTS=0 */

/*
 * Header page. Offsets are part of the format (checked below).
 */
struct sg_ring_header {
	uint64_t magic;            /*   0 SG_RING_MAGIC, stored last */
	uint32_t version;          /*   8 SG_RING_VERSION */
	uint32_t header_size;      /*  12 bytes before slot 0 */
	uint32_t record_size;      /*  16 bytes per record */
	uint32_t capacity;         /*  20 records, power of two */
	uint32_t job_id;           /*  24 Slurm job id (0 if unknown) */
	uint32_t step_id;          /*  28 Slurm step id (SG_STEP_* for special) */
	int32_t global_rank;       /*  32 rank in the job, -1 if unknown */
	int32_t local_rank;        /*  36 rank on this node, -1 if unknown */
	int32_t world_size;        /*  40 ranks in the job, 0 if unknown */
	uint32_t pid;              /*  44 writer process id */
	int64_t clock_offset_ns;   /*  48 CLOCK_REALTIME - CLOCK_MONOTONIC at creation */
	uint64_t created_ns;       /*  56 CLOCK_MONOTONIC at creation */
	uint32_t source;           /*  64 SG_SOURCE_* */
	_Atomic uint32_t header_flags; /*  68 SG_HF_* */
	char node_name[SG_NODE_NAME_LEN]; /* 72 Slurm node name, NUL-terminated */
	uint8_t reserved1[192 - 136];
	/* written on every record: kept off the lines the controller writes */
	_Atomic uint64_t write_counter; /* 192 record numbers ever reserved */
	_Atomic uint64_t overwritten;   /* 200 records lost to overwrite */
	/* GPU timing (written by the writer, rarely) */
	_Atomic uint64_t gpu_lost;      /* 208 calls whose GPU times never came (exit,
					 * timing turned off with events in flight) */
	_Atomic uint32_t gpu_state;     /* 216 SG_GPU_* */
	_Atomic int32_t gpu_error;      /* 220 CUDA error code that turned timing off */
	/* calls in flight (kept by writers that set SG_HF_IN_FLIGHT) */
	_Atomic uint32_t in_flight;     /* 224 calls entered, not yet recorded nor lost */
	uint32_t reserved2;             /* 228 0 */
	_Atomic uint64_t in_flight_since_ns; /* 232 CLOCK_MONOTONIC when in_flight
					      * last rose from 0; 0 = none */
	uint8_t reserved4[256 - 240];
	/* control block, written by the controller / agent */
	_Atomic uint32_t control;       /* 256 SG_CTL_* bits */
	uint32_t hold_timeout_ms;       /* 260 0 = SG_HOLD_DEFAULT_TIMEOUT_MS */
	_Atomic uint64_t hold_since_ns; /* 264 CLOCK_MONOTONIC when a writer
					 * entered a hold; 0 = not holding */
	_Atomic uint64_t holds;         /* 272 holds served */
	_Atomic uint64_t hold_timeouts; /* 280 holds ended by timeout */
	uint8_t reserved3[SG_RING_HEADER_SIZE - 288];
};

/*
 * One record: one intercepted call. Times are CLOCK_MONOTONIC ns of this
 * host (add clock_offset_ns for wall-clock time). For NCCL calls start/end
 * are the host entry and return of the call (enqueue, not GPU completion);
 * for torch async work end_ns is when the work completed.
 * With SG_F_GPU_TIME, gpu_start_ns/gpu_end_ns are when the call's work ran
 * on the GPU (CUDA events recorded on its stream around it, or the NCCL
 * kernel's own timer through the profiler plugin), mapped to this host's
 * CLOCK_MONOTONIC: the duration of a collective is gpu_end - gpu_start when
 * present, else end - start. A rank waiting for a slow peer shows a long GPU
 * duration; the late rank shows a late gpu_start.
 * coll_seq: NCCL's per-communicator sequence number of the collective
 * (profiler plugin; equal on all ranks for the same call), 0 if unknown.
 * peer_xfer records (profiler plugin) aggregate the proxy steps of one
 * direction (SG_F_XFER_SEND) to one peer over a window [start_ns, end_ns]:
 * count = steps, bytes = bytes moved, xfer_net_ns = time steps spent on
 * the network (SendWait / RecvWait), xfer_peer_wait_ns = time a send waited
 * for the peer's clear-to-send, xfer_gpu_wait_ns = time steps waited for the
 * local GPU (SendGPUWait, RecvFlushWait, RecvGPUWait), xfer_channels =
 * bitmask of the channels (id % 64) the steps used, xfer_ops = proxy ops.
 * count is the call's count argument in elements (per rank for allgather,
 * reducescatter and alltoall, as in the NCCL API); bytes = count * element size.
 * comm_init / comm_split records carry the communicator size in count and the
 * rank's position in it in peer.
 */
struct sg_record {
	_Atomic uint64_t seq; /*  0 commit word: n + 1 once record n is complete */
	uint64_t comm_id;     /*  8 communicator id, equal on all its ranks */
	uint64_t count;       /* 16 elements */
	uint64_t bytes;       /* 24 count * element size */
	uint64_t start_ns;    /* 32 call entry, CLOCK_MONOTONIC */
	uint64_t end_ns;      /* 40 call return, or completion of async work */
	int32_t peer;         /* 48 peer (send/recv), root (bcast/reduce/gather/
			       *    scatter), own rank (comm_init/split), else -1 */
	uint16_t op;          /* 52 enum sg_op */
	uint8_t datatype;     /* 54 enum sg_datatype */
	uint8_t redop;        /* 55 enum sg_redop */
	uint32_t flags;       /* 56 SG_F_* */
	int32_t status;       /* 60 library return code (0 = success) */
	uint64_t gpu_start_ns; /* 64 work started on the GPU (SG_F_GPU_TIME) */
	uint64_t gpu_end_ns;   /* 72 work finished on the GPU (SG_F_GPU_TIME) */
	uint64_t coll_seq;     /* 80 NCCL sequence number in the communicator, 0 unknown */
	uint64_t xfer_net_ns;       /* 88 peer_xfer: steps on the network */
	uint64_t xfer_peer_wait_ns; /* 96 peer_xfer: sends waiting for the peer */
	uint64_t xfer_gpu_wait_ns;  /* 104 peer_xfer: steps waiting for the local GPU */
	uint64_t xfer_channels;     /* 112 peer_xfer: channel bitmask */
	uint32_t xfer_ops;          /* 120 peer_xfer: proxy operations */
	uint32_t reserved;          /* 124 0 */
};

_Static_assert(sizeof(struct sg_ring_header) == SG_RING_HEADER_SIZE, "header size");
_Static_assert(sizeof(struct sg_record) == SG_RING_RECORD_SIZE, "record size");
_Static_assert(offsetof(struct sg_ring_header, node_name) == 72, "node_name");
_Static_assert(offsetof(struct sg_ring_header, write_counter) == 192, "write_counter");
_Static_assert(offsetof(struct sg_ring_header, control) == 256, "control");
_Static_assert(offsetof(struct sg_ring_header, hold_timeouts) == 280, "hold_timeouts");
_Static_assert(offsetof(struct sg_record, peer) == 48, "peer");
_Static_assert(offsetof(struct sg_record, status) == 60, "status");
_Static_assert(offsetof(struct sg_record, gpu_start_ns) == 64, "gpu_start_ns");
_Static_assert(offsetof(struct sg_record, xfer_ops) == 120, "xfer_ops");
_Static_assert(offsetof(struct sg_ring_header, gpu_lost) == 208, "gpu_lost");
_Static_assert(offsetof(struct sg_ring_header, in_flight) == 224, "in_flight");
_Static_assert(offsetof(struct sg_ring_header, in_flight_since_ns) == 232, "in_flight_since_ns");

/* numbers one block reservation takes (only in rings of >= 256 records) */
#define SG_RING_BLOCK 64u

static inline struct sg_record *sg_ring_slots(struct sg_ring_header *h)
{
	return (struct sg_record *)((char *)h + SG_RING_HEADER_SIZE);
}

static inline size_t sg_ring_file_size(uint32_t capacity)
{
	return (size_t)SG_RING_HEADER_SIZE + (size_t)capacity * SG_RING_RECORD_SIZE;
}

/*
 * Reserve record number *n and mark its slot "being written"; fill the
 * returned slot's fields (not seq) and call sg_ring_commit. Lock-free and
 * wait-free: one atomic add and plain stores, whatever readers do.
 */
static inline struct sg_record *sg_ring_reserve(struct sg_ring_header *h, uint64_t *n)
{
	uint64_t i = atomic_fetch_add_explicit(&h->write_counter, 1, memory_order_relaxed);
	struct sg_record *s = sg_ring_slots(h) + (i & (h->capacity - 1));

	atomic_store_explicit(&s->seq, 0, memory_order_relaxed);
	atomic_thread_fence(memory_order_release);
	*n = i;
	return s;
}

static inline void sg_ring_commit(struct sg_ring_header *h, struct sg_record *s, uint64_t n)
{
	uint32_t cap = h->capacity;

	atomic_store_explicit(&s->seq, n + 1, memory_order_release);
	if (__builtin_expect(n >= cap, 0))
		atomic_store_explicit(&h->overwritten, n + 1 - cap, memory_order_relaxed);
}

/* Copy every field but the commit word (plain stores: the commit protocol
 * orders them). */
static inline void sg_record_copy_body(struct sg_record *dst, const struct sg_record *src)
{
	memcpy((char *)dst + sizeof(dst->seq), (const char *)src + sizeof(src->seq),
	       sizeof(*dst) - sizeof(dst->seq));
}

/* Append a copy of *r (r->seq is ignored). Returns the record number. */
static inline uint64_t sg_ring_append(struct sg_ring_header *h, const struct sg_record *r)
{
	uint64_t n;
	struct sg_record *s = sg_ring_reserve(h, &n);

	sg_record_copy_body(s, r);
	sg_ring_commit(h, s, n);
	return n;
}

/*
 * The header's in-flight count (SG_HF_IN_FLIGHT), shared by the writers that
 * keep it: add when a call enters, done exactly once when it is recorded or
 * given up, before its record is committed (a reader that sees the record
 * sees it done). in_flight_since_ns is set by the call that raises the count
 * from 0 and cleared by the one that brings it back, unless another call
 * raised it meanwhile (the compare-exchange then fails: a hang that starts
 * right after must not read as "since now" for good).
 */
static inline void sg_ring_inflight_add(struct sg_ring_header *h, uint64_t start_ns)
{
	if (atomic_fetch_add(&h->in_flight, 1) == 0)
		atomic_store(&h->in_flight_since_ns, start_ns ? start_ns : 1);
}

static inline void sg_ring_inflight_done(struct sg_ring_header *h)
{
	uint64_t since;

	if (atomic_fetch_sub(&h->in_flight, 1) != 1)
		return;
	since = atomic_load(&h->in_flight_since_ns);
	if (atomic_load(&h->in_flight) == 0)
		atomic_compare_exchange_strong(&h->in_flight_since_ns, &since, 0);
}

enum sg_read_result {
	SG_READ_OK = 0,          /* *out holds record n */
	SG_READ_NOT_YET = 1,     /* record n is reserved but not committed */
	SG_READ_OVERWRITTEN = 2, /* record n was overwritten (lost) */
	SG_READ_TORN = 3         /* overwritten while copying; retry or count lost */
};

/* Copy record n into *out, following the commit protocol above. */
static inline enum sg_read_result sg_ring_read(struct sg_ring_header *h, uint64_t n,
					       struct sg_record *out)
{
	struct sg_record *s = sg_ring_slots(h) + (n & (h->capacity - 1));
	uint64_t s1 = atomic_load_explicit(&s->seq, memory_order_acquire);
	uint64_t s2;

	if (s1 < n + 1)
		return SG_READ_NOT_YET;
	if (s1 > n + 1)
		return SG_READ_OVERWRITTEN;
	sg_record_copy_body(out, s);
	atomic_thread_fence(memory_order_acquire);
	s2 = atomic_load_explicit(&s->seq, memory_order_relaxed);
	if (s2 != s1)
		return SG_READ_TORN;
	atomic_store_explicit(&out->seq, s1, memory_order_relaxed);
	return SG_READ_OK;
}

/* Element size in bytes of an sg_datatype; 0 when unknown. */
static inline uint32_t sg_datatype_size(unsigned dt)
{
	static const uint8_t sizes[SG_DT_COUNT] = {
		0, 1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1, 1, 2, 2, 8, 16,
	};
	return dt < SG_DT_COUNT ? sizes[dt] : 0;
}

/* The <step> part of a ring file name: Slurm's special steps by name, others
 * by number (buf holds the number; it must hold 11 bytes). */
static inline const char *sg_step_name(uint32_t step, char *buf, size_t len)
{
	switch (step) {
	case SG_STEP_BATCH:
		return "batch";
	case SG_STEP_EXTERN:
		return "extern";
	case SG_STEP_INTERACTIVE:
		return "interactive";
	default:
		snprintf(buf, len, "%u", step);
		return buf;
	}
}

#endif /* SG_RING_H */
