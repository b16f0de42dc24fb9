/*
 * nccl_profiler.c - libslurmguard_nccl_profiler.so, an NCCL profiler plugin
 * (NCCL_PROFILER_PLUGIN=/abs/path/libslurmguard_nccl_profiler.so) that
 * writes this rank's ring (rank-<r>.step-<s>.ncclprof.ring, format in
 * sg_ring.h) from NCCL's own events instead of intercepting its API:
 *
 *  - one record per collective / p2p operation: host start/stop of the
 *    enqueue (the Coll/P2p event), GPU start/end from the kernel's own
 *    channel timers (KernelCh events: the GPU globaltimer at each channel's
 *    start and stop; earliest start, latest stop), NCCL's sequence number;
 *    written when the operation has stopped and all of its nChannels
 *    kernel channels have (operations still waiting when the communicator
 *    is finalised, or more than MAX_WAITING of them, are written with host
 *    times only);
 *  - network activity aggregated in the plugin, never one record per step:
 *    every ProxyStep's time in each state is summed per communicator, peer
 *    and direction (network, waiting for the peer, waiting for the local
 *    GPU, bytes, steps, channels) and written as one peer_xfer record per
 *    peer and direction every SLURMGUARD_XFER_INTERVAL_MS (default 1000)
 *    and when the communicator is finalised: the per-link transfer times
 *    that tell which link of a ring is slow (Mycroft, Table 4);
 *  - the header's in-flight count (SG_HF_IN_FLIGHT, set at creation): an
 *    operation is in flight from its Coll/P2p start event until its record
 *    is written, i.e. until its kernel channels have stopped too (NCCL
 *    returns from the enqueue long before the GPU work runs; a hung
 *    collective is one whose kernel never finishes), or until it is written
 *    with host times at finalize or overflow. So the agent tells a rank
 *    blocked inside a collective from one between collectives;
 *  - the hold control word served at the next collective, as in the hook.
 *
 * The GPU globaltimer is mapped to CLOCK_MONOTONIC by the smallest
 * (host receipt - GPU stamp) seen over the last two 5 s windows: the host
 * always learns of a stamp after it was taken, so the smallest difference
 * is the offset plus the shortest delivery delay (microseconds).
 *
 * Offered interface versions: ncclProfiler_v6 (NCCL >= 2.29), v5 (2.28),
 * v4 (2.27); older NCCL has no GPU timers in kernel events and keeps the
 * LD_PRELOAD hook. When NCCL calls init, the plugin tells a preloaded hook
 * (slurmguard_hook_defer) to stop recording: one writer per call.
 *
 * As the interface asks, nothing here ever returns an error to NCCL except
 * init (which makes NCCL run without the plugin): a full ring, a missing
 * ring directory or an allocation failure drops data, never the job.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nccl_profiler_api.h"
#include "sg_ring.h"
#include "sg_ring_file.h"

#define EXPORT __attribute__((visibility("default")))
#define XFER_SLOTS 128
#define MAX_WAITING 4096
#define WINDOW_NS 5000000000ull

enum kind { K_COLL = 1, K_P2P, K_KCH, K_OP, K_STEP };

struct xfer {
	int peer; /* comm rank; -2 = free slot, -1 = overflow */
	int send;
	uint64_t steps, bytes, net_ns, peer_wait_ns, gpu_wait_ns, channels, first_ns, last_ns;
	uint32_t ops;
};

struct ctx {
	uint64_t comm_id;
	int rank, nranks;
	pthread_mutex_t mu;
	struct xfer xfer[XFER_SLOTS];
	uint64_t last_flush;
	struct ev *waiting; /* operations waiting for kernel channels, oldest last */
	unsigned nwaiting;
	/* operations written at overflow: NCCL may still pass their handles
	 * (a late stop or kernel event), so they are freed at finalize only */
	struct ev *dead;
	/* events NCCL started, by type (Coll, P2p, KernelCh, ProxyOp, ProxyStep):
	 * SLURMGUARD_PROFILER_DEBUG=1 prints them at finalize */
	_Atomic uint64_t seen[5];
	int iface;
};

struct ev {
	enum kind kind;
	struct ctx *ctx;
	struct ev *parent;
	/* coll/p2p: 1 until stopped + kernel channels not yet stopped */
	_Atomic int refs;
	struct ev *prev, *next; /* coll/p2p: in ctx->waiting, then ctx->dead */
	union {
		struct {
			uint16_t op;
			uint8_t datatype;
			int32_t peer;
			uint64_t count, seq, t0, t1, gpu_min, gpu_max;
			uint32_t channels;
		} op;     /* K_COLL, K_P2P */
		struct {
			uint64_t gpu_start;
		} kch;
		struct {
			int peer, send;
			uint8_t channel;
		} pop;    /* K_OP */
		struct {
			int state, peer, send;
			uint8_t channel;
			uint64_t t_state, t0, bytes, net, peer_wait, gpu_wait;
		} step;   /* K_STEP: its op's link, copied (the op may stop first) */
	} u;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sg_ring_header *g_ring;
static int g_ring_tried;
static uint64_t g_interval_ns = 1000000000ull;
/* globaltimer -> CLOCK_MONOTONIC offset: min over this and the last window */
static int64_t g_off_cur = INT64_MAX, g_off_prev = INT64_MAX;
static uint64_t g_off_window;

static inline uint64_t now(void)
{
	return sg_mono_ns();
}

/* ------------------------------------------------------------------ clock */

static void gt_observe(uint64_t host, uint64_t gpu)
{
	int64_t d = (int64_t)(host - gpu);

	pthread_mutex_lock(&g_mu);
	if (host - g_off_window > WINDOW_NS) {
		/* drift between the two clocks: forget old minima slowly */
		g_off_prev = g_off_cur;
		g_off_cur = INT64_MAX;
		g_off_window = host;
	}
	if (d < g_off_cur)
		g_off_cur = d;
	pthread_mutex_unlock(&g_mu);
}

static uint64_t gt_to_host(uint64_t gpu)
{
	int64_t off;

	pthread_mutex_lock(&g_mu);
	off = g_off_cur < g_off_prev ? g_off_cur : g_off_prev;
	pthread_mutex_unlock(&g_mu);
	return gpu + (uint64_t)off;
}

/* ------------------------------------------------------------------ names */

static uint16_t op_of(const char *func)
{
	static const struct {
		const char *name;
		uint16_t op;
	} map[] = {
		{ "AllReduce", SG_OP_ALLREDUCE },   { "AllGather", SG_OP_ALLGATHER },
		{ "ReduceScatter", SG_OP_REDUCESCATTER }, { "Broadcast", SG_OP_BROADCAST },
		{ "Reduce", SG_OP_REDUCE },         { "AllToAll", SG_OP_ALLTOALL },
		{ "AlltoAll", SG_OP_ALLTOALL },     { "Send", SG_OP_SEND },
		{ "Recv", SG_OP_RECV },             { "Gather", SG_OP_GATHER },
		{ "Scatter", SG_OP_SCATTER },
	};
	size_t i;

	for (i = 0; func && i < sizeof(map) / sizeof(map[0]); i++)
		if (strcmp(func, map[i].name) == 0)
			return map[i].op;
	return SG_OP_NONE;
}

/* NCCL's ncclDatatypeToString names */
static uint8_t dt_of(const char *name)
{
	static const char *const names[] = {
		"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
		"ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3",
		"ncclFloat8e5m2",
	};
	static const uint8_t sg[] = {
		SG_DT_INT8,    SG_DT_UINT8,    SG_DT_INT32,   SG_DT_UINT32,  SG_DT_INT64,
		SG_DT_UINT64,  SG_DT_FLOAT16,  SG_DT_FLOAT32, SG_DT_FLOAT64, SG_DT_BFLOAT16,
		SG_DT_FP8E4M3, SG_DT_FP8E5M2,
	};
	size_t i;

	for (i = 0; name && i < sizeof(names) / sizeof(names[0]); i++)
		if (strcmp(name, names[i]) == 0)
			return sg[i];
	return SG_DT_UNKNOWN;
}

/* ------------------------------------------------------------------ records */

static void append(const struct sg_record *r)
{
	struct sg_ring_header *h = __atomic_load_n(&g_ring, __ATOMIC_ACQUIRE);

	if (h)
		sg_ring_append(h, r);
}

static void emit_op(struct ev *e)
{
	struct sg_record r;

	memset(&r, 0, sizeof(r));
	r.comm_id = e->ctx->comm_id;
	r.count = e->u.op.count;
	r.bytes = e->u.op.count * sg_datatype_size(e->u.op.datatype);
	r.start_ns = e->u.op.t0;
	r.end_ns = e->u.op.t1 >= e->u.op.t0 ? e->u.op.t1 : e->u.op.t0;
	r.peer = e->u.op.peer;
	r.op = e->u.op.op;
	r.datatype = e->u.op.datatype;
	r.coll_seq = e->u.op.seq;
	if (e->u.op.channels && e->u.op.gpu_max >= e->u.op.gpu_min) {
		r.gpu_start_ns = gt_to_host(e->u.op.gpu_min);
		r.gpu_end_ns = gt_to_host(e->u.op.gpu_max);
		r.flags = SG_F_GPU_TIME;
	} else {
		r.flags = SG_F_NO_EVENT; /* no kernel timer came (e.g. not enabled) */
	}
	append(&r);
}

static void emit_meta(struct ctx *c, uint16_t op)
{
	struct sg_record r;

	memset(&r, 0, sizeof(r));
	r.comm_id = c->comm_id;
	r.count = (uint64_t)(c->nranks > 0 ? c->nranks : 0);
	r.peer = c->rank;
	r.op = op;
	r.start_ns = r.end_ns = now();
	append(&r);
}

/* c->mu held */
static void flush_xfer(struct ctx *c, uint64_t t)
{
	int i;

	for (i = 0; i < XFER_SLOTS; i++) {
		struct xfer *x = &c->xfer[i];
		struct sg_record r;

		if (x->peer == -2 || x->steps == 0)
			continue;
		memset(&r, 0, sizeof(r));
		r.comm_id = c->comm_id;
		r.op = SG_OP_PEER_XFER;
		r.peer = x->peer;
		r.count = x->steps;
		r.bytes = x->bytes;
		r.start_ns = x->first_ns;
		r.end_ns = x->last_ns >= x->first_ns ? x->last_ns : x->first_ns;
		r.flags = x->send ? SG_F_XFER_SEND : 0;
		r.xfer_net_ns = x->net_ns;
		r.xfer_peer_wait_ns = x->peer_wait_ns;
		r.xfer_gpu_wait_ns = x->gpu_wait_ns;
		r.xfer_channels = x->channels;
		r.xfer_ops = x->ops;
		append(&r);
		x->steps = x->bytes = x->net_ns = x->peer_wait_ns = x->gpu_wait_ns = 0;
		x->channels = 0;
		x->ops = 0;
		x->first_ns = x->last_ns = 0;
	}
	c->last_flush = t;
}

/* c->mu held: the aggregate of (peer, direction) */
static struct xfer *xfer_of(struct ctx *c, int peer, int send)
{
	unsigned h = ((unsigned)peer * 2654435761u + (unsigned)send) % XFER_SLOTS, i;

	for (i = 0; i < XFER_SLOTS; i++) {
		struct xfer *x = &c->xfer[(h + i) % XFER_SLOTS];

		if (x->peer == -2) {
			memset(x, 0, sizeof(*x));
			x->peer = peer;
			x->send = send;
			return x;
		}
		if (x->peer == peer && x->send == send)
			return x;
	}
	/* more than XFER_SLOTS links in one communicator: lump the rest */
	for (i = 0; i < XFER_SLOTS; i++)
		if (c->xfer[i].peer == -1 && c->xfer[i].send == send)
			return &c->xfer[i];
	return &c->xfer[h];
}

/* ------------------------------------------------------------------ events */

/*
 * A coll/p2p operation is in flight (the header's count) exactly while it is
 * on its communicator's waiting list: linked at its start event, unlinked
 * once, by the reference that writes its full record or by drain_waiting,
 * each before the record is written. One place for both keeps every path
 * that ends an operation to one decrement.
 */

/* c->mu held */
static void link_waiting(struct ctx *c, struct ev *e)
{
	struct sg_ring_header *h = __atomic_load_n(&g_ring, __ATOMIC_ACQUIRE);

	e->prev = NULL;
	e->next = c->waiting;
	if (c->waiting)
		c->waiting->prev = e;
	c->waiting = e;
	c->nwaiting++;
	if (h)
		sg_ring_inflight_add(h, e->u.op.t0);
}

/* c->mu held */
static void unlink_waiting(struct ctx *c, struct ev *e)
{
	struct sg_ring_header *h = __atomic_load_n(&g_ring, __ATOMIC_ACQUIRE);

	if (e->prev)
		e->prev->next = e->next;
	else
		c->waiting = e->next;
	if (e->next)
		e->next->prev = e->prev;
	e->prev = e->next = NULL;
	c->nwaiting--;
	if (h)
		sg_ring_inflight_done(h);
}

/* A coll/p2p reference dropped: by its stop or a kernel channel's. The
 * last one writes the record. */
static void release_op(struct ev *e)
{
	struct ctx *c = e->ctx;
	int last;

	pthread_mutex_lock(&c->mu);
	last = atomic_fetch_sub(&e->refs, 1) == 1;
	if (last)
		unlink_waiting(c, e);
	pthread_mutex_unlock(&c->mu);
	if (last) {
		emit_op(e);
		free(e);
	}
}

/* c->mu held: write the oldest waiting operations, down to `keep`, with
 * what they have (host times; GPU times if all channels came). With
 * `release` (finalize: NCCL sends no event of this communicator after it)
 * they are freed; otherwise kept as dead handles on c->dead, so that a late
 * kernel event or stop finds no parent instead of freed memory. */
static void drain_waiting(struct ctx *c, unsigned keep, int release)
{
	while (c->nwaiting > keep) {
		struct ev *last = c->waiting; /* nwaiting > 0: not NULL */

		while (last->next)
			last = last->next;
		unlink_waiting(c, last);
		atomic_store(&last->refs, 0);
		last->kind = 0; /* a stale handle from NCCL is recognised as none */
		emit_op(last);
		if (release) {
			free(last);
		} else {
			last->next = c->dead;
			c->dead = last;
		}
	}
}

/* finalize: NCCL passes no handle of this communicator any more */
static void free_dead(struct ctx *c)
{
	while (c->dead) {
		struct ev *e = c->dead;

		c->dead = e->next;
		free(e);
	}
}

static void hold_point(void)
{
	struct sg_ring_header *h = __atomic_load_n(&g_ring, __ATOMIC_ACQUIRE);

	if (h && (atomic_load_explicit(&h->control, memory_order_relaxed) & SG_CTL_HOLD)) {
		struct sg_record r;
		uint64_t t0, t1;

		memset(&r, 0, sizeof(r));
		r.flags = sg_ring_hold(h, &t0, &t1);
		r.op = SG_OP_HOLD;
		r.peer = -1;
		r.start_ns = t0;
		r.end_ns = t1;
		sg_ring_append(h, &r);
	}
}

/* the parent handle NCCL passes back, if it is one of ours in this process */
static struct ev *parent_of(void *obj, enum kind want1, enum kind want2)
{
	struct ev *p = obj;

	return p && ((int)p->kind == (int)want1 || (int)p->kind == (int)want2) ? p : NULL;
}

static ncclResult_t start_common(struct ctx *c, void **handle, uint64_t type, void *parentObj,
				 const union sg_nccl_prof_descr_u *u)
{
	struct ev *e, *parent = NULL;

	*handle = NULL;
	if (!c)
		return ncclSuccess;
	switch (type) {
	case ncclProfileColl:
		atomic_fetch_add_explicit(&c->seen[0], 1, memory_order_relaxed);
		hold_point();
		break;
	case ncclProfileP2p:
		atomic_fetch_add_explicit(&c->seen[1], 1, memory_order_relaxed);
		hold_point();
		break;
	case ncclProfileKernelCh:
		atomic_fetch_add_explicit(&c->seen[2], 1, memory_order_relaxed);
		parent = parent_of(parentObj, K_COLL, K_P2P);
		if (!parent)
			return ncclSuccess;
		break;
	case ncclProfileProxyOp:
		atomic_fetch_add_explicit(&c->seen[3], 1, memory_order_relaxed);
		/* aggregated per link, never tied to its parent (which, with PXN,
		 * may belong to another process) */
		break;
	case ncclProfileProxyStep:
		atomic_fetch_add_explicit(&c->seen[4], 1, memory_order_relaxed);
		parent = parent_of(parentObj, K_OP, K_OP);
		if (!parent)
			return ncclSuccess;
		break;
	default:
		return ncclSuccess;
	}
	e = calloc(1, sizeof(*e));
	if (!e)
		return ncclSuccess;
	e->ctx = c;
	e->parent = parent;
	atomic_store(&e->refs, 1);
	switch (type) {
	case ncclProfileColl:
		e->kind = K_COLL;
		/* the kernel reports each of its channels once */
		atomic_store(&e->refs, 1 + u->coll.nChannels);
		e->u.op.op = op_of(u->coll.func);
		e->u.op.datatype = dt_of(u->coll.datatype);
		e->u.op.count = u->coll.count;
		e->u.op.peer = (e->u.op.op == SG_OP_BROADCAST || e->u.op.op == SG_OP_REDUCE) ?
				       u->coll.root : -1;
		e->u.op.seq = u->coll.seqNumber + 1; /* 0 means unknown */
		e->u.op.t0 = now();
		break;
	case ncclProfileP2p:
		e->kind = K_P2P;
		e->u.op.op = op_of(u->p2p.func);
		e->u.op.datatype = dt_of(u->p2p.datatype);
		e->u.op.count = u->p2p.count;
		e->u.op.peer = u->p2p.peer;
		e->u.op.t0 = now();
		atomic_store(&e->refs, 1 + u->p2p.nChannels);
		break;
	case ncclProfileKernelCh:
		e->kind = K_KCH;
		e->u.kch.gpu_start = u->kernelCh.pTimer;
		gt_observe(now(), u->kernelCh.pTimer);
		break;
	case ncclProfileProxyOp:
		e->kind = K_OP;
		e->u.pop.peer = u->proxyOp.peer;
		e->u.pop.send = u->proxyOp.isSend != 0;
		e->u.pop.channel = u->proxyOp.channelId;
		pthread_mutex_lock(&c->mu);
		xfer_of(c, e->u.pop.peer, e->u.pop.send)->ops++;
		pthread_mutex_unlock(&c->mu);
		break;
	case ncclProfileProxyStep:
		e->kind = K_STEP;
		e->u.step.t0 = e->u.step.t_state = now();
		e->u.step.state = -1;
		e->u.step.peer = parent->u.pop.peer;
		e->u.step.send = parent->u.pop.send;
		e->u.step.channel = parent->u.pop.channel;
		e->parent = NULL;
		break;
	}
	if (e->kind == K_COLL || e->kind == K_P2P) {
		pthread_mutex_lock(&c->mu);
		link_waiting(c, e);
		/* kernel events that never come must not pile up */
		drain_waiting(c, MAX_WAITING, 0);
		pthread_mutex_unlock(&c->mu);
	}
	*handle = e;
	return ncclSuccess;
}

/* where a step's time in `state` goes */
static uint64_t *bucket(struct ev *s, int state)
{
	switch (state) {
	case ncclProfilerProxyStepSendWait:
	case ncclProfilerProxyStepRecvWait:
		return &s->u.step.net;
	case ncclProfilerProxyStepSendPeerWait_v4:
		return &s->u.step.peer_wait;
	case ncclProfilerProxyStepSendGPUWait:
	case ncclProfilerProxyStepRecvFlushWait:
	case ncclProfilerProxyStepRecvGPUWait:
		return &s->u.step.gpu_wait;
	default:
		return NULL;
	}
}

static void step_close_state(struct ev *s, uint64_t t)
{
	uint64_t *b = bucket(s, s->u.step.state);

	if (b && t > s->u.step.t_state)
		*b += t - s->u.step.t_state;
	s->u.step.t_state = t;
}

static ncclResult_t sg_stop(void *handle)
{
	struct ev *e = handle;
	uint64_t t = now();

	if (!e)
		return ncclSuccess;
	switch ((int)e->kind) {
	case 0:
		return ncclSuccess; /* drained at finalize or overflow */
	case K_COLL:
	case K_P2P:
		e->u.op.t1 = t; /* enqueued */
		release_op(e);
		return ncclSuccess;
	case K_KCH: {
		struct ev *op = e->parent;
		int live;

		free(e);
		pthread_mutex_lock(&op->ctx->mu);
		live = (int)op->kind == K_COLL || (int)op->kind == K_P2P;
		pthread_mutex_unlock(&op->ctx->mu);
		if (live)
			release_op(op);
		return ncclSuccess;
	}
	case K_OP:
		break;
	case K_STEP: {
		struct ctx *c = e->ctx;
		struct xfer *x;

		step_close_state(e, t);
		pthread_mutex_lock(&c->mu);
		x = xfer_of(c, e->u.step.peer, e->u.step.send);
		x->steps++;
		x->bytes += e->u.step.bytes;
		x->net_ns += e->u.step.net;
		x->peer_wait_ns += e->u.step.peer_wait;
		x->gpu_wait_ns += e->u.step.gpu_wait;
		x->channels |= 1ull << (e->u.step.channel % 64);
		if (!x->first_ns || e->u.step.t0 < x->first_ns)
			x->first_ns = e->u.step.t0;
		if (t > x->last_ns)
			x->last_ns = t;
		if (t - c->last_flush >= g_interval_ns)
			flush_xfer(c, t);
		pthread_mutex_unlock(&c->mu);
		break;
	}
	}
	free(e);
	return ncclSuccess;
}

static ncclResult_t sg_record_state(void *handle, ncclProfilerEventState_t state,
				    ncclProfilerEventStateArgs_v4_t *args)
{
	struct ev *e = handle;

	if (!e)
		return ncclSuccess;
	if (e->kind == K_STEP) {
		step_close_state(e, now());
		e->u.step.state = (int)state;
		if (args && bucket(e, (int)state))
			e->u.step.bytes = args->proxyStep.transSize;
	} else if (e->kind == K_KCH && state == ncclProfilerKernelChStop && args) {
		struct ev *op = e->parent;
		uint64_t stop = args->kernelCh.pTimer;

		gt_observe(now(), stop);
		pthread_mutex_lock(&e->ctx->mu);
		if ((int)op->kind == 0) {
			pthread_mutex_unlock(&e->ctx->mu);
			return ncclSuccess; /* written already */
		}
		if (!op->u.op.channels || e->u.kch.gpu_start < op->u.op.gpu_min)
			op->u.op.gpu_min = e->u.kch.gpu_start;
		if (stop > op->u.op.gpu_max)
			op->u.op.gpu_max = stop;
		op->u.op.channels++;
		pthread_mutex_unlock(&e->ctx->mu);
	}
	return ncclSuccess;
}

/* ------------------------------------------------------------------ init / finalize */

static ncclResult_t init_common(int iface, void **context, int *mask, uint64_t comm_id, int nranks,
				int rank)
{
	struct ctx *c;
	void (*defer)(void);
	int i;

	*context = NULL;
	pthread_mutex_lock(&g_mu);
	if (!g_ring_tried) {
		const char *iv = getenv("SLURMGUARD_XFER_INTERVAL_MS");

		g_ring_tried = 1;
		if (iv && atol(iv) > 0)
			g_interval_ns = (uint64_t)atol(iv) * 1000000ull;
		__atomic_store_n(&g_ring, sg_ring_create_for_rank("ncclprof", SG_SOURCE_NCCL_PROFILER,
								  rank, nranks),
				 __ATOMIC_RELEASE);
		if (g_ring) {
			atomic_store(&g_ring->gpu_state, SG_GPU_ON);
			atomic_fetch_or(&g_ring->header_flags, SG_HF_IN_FLIGHT);
		}
	}
	pthread_mutex_unlock(&g_mu);
	if (!g_ring)
		return ncclSystemError; /* not guarded: NCCL runs without us */
	c = calloc(1, sizeof(*c));
	if (!c)
		return ncclSystemError;
	pthread_mutex_init(&c->mu, NULL);
	c->comm_id = comm_id ? comm_id : 1;
	c->rank = rank;
	c->nranks = nranks;
	c->iface = iface;
	c->last_flush = now();
	for (i = 0; i < XFER_SLOTS; i++)
		c->xfer[i].peer = -2;
	/* NCCL runs the plugin: a preloaded hook stops recording */
	defer = (void (*)(void))dlsym(RTLD_DEFAULT, "slurmguard_hook_defer");
	if (defer)
		defer();
	emit_meta(c, SG_OP_COMM_INIT);
	*mask = ncclProfileColl | ncclProfileP2p | ncclProfileProxyOp | ncclProfileProxyStep |
		ncclProfileKernelCh;
	*context = c;
	return ncclSuccess;
}

static ncclResult_t sg_finalize(void *context)
{
	struct ctx *c = context;
	const char *dbg;

	if (!c)
		return ncclSuccess;
	dbg = getenv("SLURMGUARD_PROFILER_DEBUG");
	if (dbg && *dbg == '1')
		fprintf(stderr,
			"slurmguard profiler: interface v%d, comm %016llx rank %d/%d: events coll %llu "
			"p2p %llu kernel_ch %llu proxy_op %llu proxy_step %llu\n",
			c->iface, (unsigned long long)c->comm_id, c->rank, c->nranks,
			(unsigned long long)c->seen[0], (unsigned long long)c->seen[1],
			(unsigned long long)c->seen[2], (unsigned long long)c->seen[3],
			(unsigned long long)c->seen[4]);
	pthread_mutex_lock(&c->mu);
	drain_waiting(c, 0, 1);
	free_dead(c);
	flush_xfer(c, now());
	pthread_mutex_unlock(&c->mu);
	emit_meta(c, SG_OP_COMM_DESTROY);
	pthread_mutex_destroy(&c->mu);
	free(c);
	return ncclSuccess;
}

static ncclResult_t init_v4(void **context, int *mask, const char *name, uint64_t hash,
			    int nnodes, int nranks, int rank, ncclDebugLogger_t logfn)
{
	(void)name;
	(void)nnodes;
	(void)logfn;
	return init_common(4, context, mask, hash, nranks, rank);
}

static ncclResult_t start_v4(void *context, void **handle, ncclProfilerEventDescr_v4_t *d)
{
	return start_common(context, handle, d->type, d->parentObj, &d->u);
}

static ncclResult_t init_v5(void **context, uint64_t id, int *mask, const char *name, int nnodes,
			    int nranks, int rank, ncclDebugLogger_t logfn)
{
	(void)name;
	(void)nnodes;
	(void)logfn;
	return init_common(5, context, mask, id, nranks, rank);
}

/* v6 has v5's init signature; only the version it reports differs */
static ncclResult_t init_v6(void **context, uint64_t id, int *mask, const char *name, int nnodes,
			    int nranks, int rank, ncclDebugLogger_t logfn)
{
	(void)name;
	(void)nnodes;
	(void)logfn;
	return init_common(6, context, mask, id, nranks, rank);
}

static ncclResult_t start_v5(void *context, void **handle, ncclProfilerEventDescr_v5_t *d)
{
	/* from v5 a Coll's parentObj is the CollApi event (not enabled here) */
	return start_common(context, handle, d->type, d->parentObj, &d->u);
}

EXPORT const ncclProfiler_v4_t ncclProfiler_v4 = {
	"slurmguard", init_v4, start_v4, sg_stop, sg_record_state, sg_finalize,
};

EXPORT const ncclProfiler_v5_t ncclProfiler_v5 = {
	"slurmguard", init_v5, start_v5, sg_stop, sg_record_state, sg_finalize,
};

EXPORT const ncclProfiler_v5_t ncclProfiler_v6 = {
	"slurmguard", init_v6, start_v5, sg_stop, sg_record_state, sg_finalize,
};
