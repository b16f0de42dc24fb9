/*
 * gpu_timing.c - CUDA-event timing of NCCL calls for the hook.
 *
 * On a GPU an NCCL call only enqueues work on a CUDA stream and returns in
 * microseconds; the collective itself, including the time a rank waits in
 * it for a slow peer, runs later on the GPU. So for each timed call the
 * hook records a timing event on the call's stream before and after it
 * (Greyhound 4.2), and a completion thread writes the record once the end
 * event has completed, with the GPU start/end mapped to CLOCK_MONOTONIC.
 *
 * Rules, in the order they matter:
 *  - the job never notices: no blocking call on the job's streams, no
 *    second CUDA runtime (the functions come from the one already loaded:
 *    dlsym(RTLD_DEFAULT), then dlopen(RTLD_NOLOAD) of libcudart), no CUDA
 *    call before the first collective (which needs an initialised
 *    communicator, hence an initialised runtime), the call's arguments,
 *    result and errno unchanged; every failure turns event timing off for
 *    this process with one line on stderr while host timing goes on;
 *  - a stream being captured into a CUDA graph gets no events (querying a
 *    captured event is invalid, and the call runs later, when the graph is
 *    launched): the record is flagged SG_F_CAPTURED; the completion thread
 *    runs in cudaStreamCaptureModeRelaxed, so its queries never invalidate
 *    a capture another thread runs in global mode;
 *  - events come from a bounded pool (SLURMGUARD_CUDA_EVENTS pairs,
 *    default 2048, 0 = off); an empty pool turns event timing off (the GPU
 *    is thousands of calls behind: something is badly wrong, and unbounded
 *    growth would be worse);
 *  - the clock: cudaEventElapsedTime from a reference event recorded on a
 *    private non-blocking stream, whose host time is measured by
 *    bracketing record + synchronize of that idle stream; re-taken every
 *    second (a float of ms loses precision over long spans), old references
 *    kept while records still use them;
 *  - exit: the thread is detached and never joined; an atexit handler
 *    (registered after the runtime's own) stops it within 20 ms, commits
 *    records whose events completed, and commits the others with host times
 *    only (SG_F_NO_EVENT), counted in header.gpu_lost. It never calls exit,
 *    never blocks on the job's work, never changes the exit status.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_timing.h"
#include "sg_ring_file.h"
#include "sg_sym.h"

#define DEFAULT_PAIRS 2048
#define MAX_PAIRS 65536
#define CHUNK 64
#define NREFS 4
#define RECAL_NS 1000000000ull

typedef cudaError_t (*ev_create_fn)(cudaEvent_t *, unsigned);
typedef cudaError_t (*ev_fn)(cudaEvent_t);
typedef cudaError_t (*ev_record_fn)(cudaEvent_t, cudaStream_t);
typedef cudaError_t (*ev_elapsed_fn)(float *, cudaEvent_t, cudaEvent_t);
typedef cudaError_t (*st_capturing_fn)(cudaStream_t, cudaStreamCaptureStatus *);
typedef cudaError_t (*st_create_fn)(cudaStream_t *, unsigned);
typedef cudaError_t (*int_out_fn)(int *);
typedef cudaError_t (*int_in_fn)(int);
typedef cudaError_t (*exch_mode_fn)(cudaStreamCaptureMode *);

static struct {
	ev_create_fn ev_create;
	ev_fn ev_sync;
	ev_record_fn ev_record;
	ev_elapsed_fn ev_elapsed;
	st_capturing_fn st_capturing;
	st_create_fn st_create;
	int_out_fn get_device;
	int_in_fn set_device;
	exch_mode_fn exch_mode;
} cu;

struct pair {
	cudaEvent_t start, end;
	int next_free;
	int ref; /* reference event current when the start was recorded */
};

enum { P_FREE = 0, P_PENDING = 1, P_FINAL = 2 };

struct pending {
	struct sg_ring_header *h;
	struct sg_record *slot;
	uint64_t n;
	cudaStream_t stream;
	int pair;
	int state;
};

struct ref {
	cudaEvent_t ev;
	uint64_t host_ns;
	int users;
};

static _Atomic uint32_t g_state = SG_GPU_UNTRIED;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct sg_ring_header *g_h;
static int g_device;
static struct pair *g_pairs;
static int g_created, g_max, g_free = -1;
static struct pending *g_q; /* FIFO of g_max entries */
static unsigned g_head, g_count;
static struct ref g_refs[NREFS];
static int g_ref = -1;
static uint64_t g_ref_time;
static cudaStream_t g_ref_stream;
static _Atomic int g_stopping, g_parked, g_thread_running;

/* ------------------------------------------------------------------ setup */

static void *cuda_sym(const char *name)
{
	/* a runtime loaded RTLD_LOCAL (torch's) is not in the global scope */
	static const char *const libs[] = { "libcudart.so.13", "libcudart.so.12",
					    "libcudart.so.11.0", "libcudart.so", NULL };

	return sg_sym_loaded(name, RTLD_DEFAULT, "SLURMGUARD_CUDART_LIBRARY", libs, NULL);
}

static int resolve(void)
{
	cu.ev_create = (ev_create_fn)cuda_sym("cudaEventCreateWithFlags");
	cu.ev_sync = (ev_fn)cuda_sym("cudaEventSynchronize");
	cu.ev_record = (ev_record_fn)cuda_sym("cudaEventRecord");
	cu.ev_elapsed = (ev_elapsed_fn)cuda_sym("cudaEventElapsedTime");
	cu.st_capturing = (st_capturing_fn)cuda_sym("cudaStreamIsCapturing");
	cu.st_create = (st_create_fn)cuda_sym("cudaStreamCreateWithFlags");
	cu.get_device = (int_out_fn)cuda_sym("cudaGetDevice");
	cu.set_device = (int_in_fn)cuda_sym("cudaSetDevice");
	cu.exch_mode = (exch_mode_fn)cuda_sym("cudaThreadExchangeStreamCaptureMode");
	return cu.ev_create && cu.ev_sync && cu.ev_record && cu.ev_elapsed &&
	       cu.st_capturing && cu.st_create && cu.get_device && cu.set_device && cu.exch_mode;
}

static const char *const why_off[] = {
	[SG_GPU_NO_RUNTIME] = "no CUDA runtime loaded in this process",
	[SG_GPU_POOL] = "event pool exhausted (the GPU is far behind the host)",
	[SG_GPU_CUDA_ERROR] = "CUDA error",
	[SG_GPU_DISABLED] = "SLURMGUARD_CUDA_EVENTS=0",
};

/* Turn event timing off for the rest of the process: one line, once. */
static void gpu_off(uint32_t why, int err)
{
	uint32_t cur = atomic_load(&g_state);

	while (cur == SG_GPU_ON || cur == SG_GPU_UNTRIED) {
		if (atomic_compare_exchange_weak(&g_state, &cur, why)) {
			if (g_h) {
				/* host times from now on: calls are recorded as they
				 * return, so the in-flight count would say nothing */
				atomic_fetch_and(&g_h->header_flags, ~SG_HF_IN_FLIGHT);
				atomic_store(&g_h->gpu_error, err);
				atomic_store(&g_h->gpu_state, why);
			}
			if (why == SG_GPU_CUDA_ERROR)
				fprintf(stderr,
					"slurmguard: GPU timing of NCCL calls off: CUDA error %d; "
					"host times only from now on\n", err);
			else if (why != SG_GPU_DISABLED)
				fprintf(stderr,
					"slurmguard: GPU timing of NCCL calls off: %s; host times "
					"only from now on\n", why_off[why]);
			return;
		}
	}
}

/* g_mu held. Grow the pool by up to CHUNK pairs; 0 if none could be added. */
static int grow_pool(void)
{
	int added = 0;

	while (g_created < g_max && added < CHUNK) {
		struct pair *p = &g_pairs[g_created];
		cudaError_t e = cu.ev_create(&p->start, cudaEventDefault);

		if (e == cudaSuccess && (e = cu.ev_create(&p->end, cudaEventDefault)) != cudaSuccess)
			p->start = NULL;
		if (e != cudaSuccess) {
			gpu_off(SG_GPU_CUDA_ERROR, e);
			return 0;
		}
		p->ref = -1;
		p->next_free = g_free;
		g_free = g_created++;
		added++;
	}
	return added;
}

/* g_mu held */
static void release_pair(int p)
{
	if (g_pairs[p].ref >= 0)
		g_refs[g_pairs[p].ref].users--;
	g_pairs[p].ref = -1;
	g_pairs[p].next_free = g_free;
	g_free = p;
}

static inline uint64_t mono(void)
{
	return sg_mono_ns();
}

/* g_mu held, relaxed capture mode. Record a new reference event on the
 * private stream and measure its host time. -1 on a CUDA error. */
static int calibrate(void)
{
	int i, slot = -1, tries;
	uint64_t best = UINT64_MAX, host = 0;
	cudaError_t e;

	for (i = 0; i < NREFS; i++)
		if (i != g_ref && g_refs[i].users == 0) {
			slot = i;
			break;
		}
	if (slot < 0)
		return 0; /* every reference still in use: keep the current one */
	if (!g_refs[slot].ev && (e = cu.ev_create(&g_refs[slot].ev, cudaEventDefault))) {
		gpu_off(SG_GPU_CUDA_ERROR, e);
		return -1;
	}
	/* the event's GPU time lies between t0 and t1; retry a descheduled try */
	for (tries = 0; tries < 3 && best > 200000; tries++) {
		uint64_t t0 = mono(), t1;

		if ((e = cu.ev_record(g_refs[slot].ev, g_ref_stream)) ||
		    (e = cu.ev_sync(g_refs[slot].ev))) {
			gpu_off(SG_GPU_CUDA_ERROR, e);
			return -1;
		}
		t1 = mono();
		best = t1 - t0;
		host = t0 + (t1 - t0) / 2;
	}
	g_refs[slot].host_ns = host;
	g_ref = slot;
	g_ref_time = mono();
	return 0;
}

static void *completion_thread(void *arg);
static void gpu_atexit(void);

static int env_pairs(void)
{
	const char *v = getenv("SLURMGUARD_CUDA_EVENTS");
	char *end;
	long x;

	if (!v || !*v)
		return DEFAULT_PAIRS;
	x = strtol(v, &end, 10);
	if (*end || x < 0)
		return DEFAULT_PAIRS;
	return x > MAX_PAIRS ? MAX_PAIRS : (int)x;
}

/* First timed call: resolve the runtime, make the pool and the reference,
 * start the completion thread. g_mu held. */
static void gpu_init(struct sg_ring_header *h)
{
	cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
	sigset_t all, old;
	pthread_attr_t attr;
	pthread_t th;
	cudaError_t e;
	int rc;

	g_h = h;
	g_max = env_pairs();
	if (g_max == 0) {
		gpu_off(SG_GPU_DISABLED, 0);
		return;
	}
	if (!resolve()) {
		gpu_off(SG_GPU_NO_RUNTIME, 0);
		return;
	}
	g_pairs = calloc((size_t)g_max, sizeof(*g_pairs));
	g_q = calloc((size_t)g_max, sizeof(*g_q));
	if (!g_pairs || !g_q) {
		gpu_off(SG_GPU_CUDA_ERROR, cudaErrorMemoryAllocation);
		return;
	}
	if ((e = cu.get_device(&g_device))) {
		gpu_off(SG_GPU_CUDA_ERROR, e);
		return;
	}
	/* relaxed while we make our own objects and synchronise our own
	 * stream: another thread may be capturing in global mode */
	if ((e = cu.exch_mode(&mode))) {
		gpu_off(SG_GPU_CUDA_ERROR, e);
		return;
	}
	e = cu.st_create(&g_ref_stream, cudaStreamNonBlocking);
	if (e)
		gpu_off(SG_GPU_CUDA_ERROR, e);
	else if (grow_pool() > 0)
		calibrate();
	cu.exch_mode(&mode);
	if (atomic_load(&g_state) != SG_GPU_UNTRIED)
		return;
	/* the thread takes no signal meant for the job */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	rc = pthread_create(&th, &attr, completion_thread, NULL);
	pthread_attr_destroy(&attr);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0) {
		gpu_off(SG_GPU_CUDA_ERROR, cudaErrorInitializationError);
		return;
	}
	atomic_store(&g_thread_running, 1);
	/* registered now, after the runtime registered its own teardown:
	 * ours runs first (atexit handlers run in reverse order) */
	atexit(gpu_atexit);
	atomic_store(&h->gpu_state, SG_GPU_ON);
	atomic_fetch_or(&h->header_flags, SG_HF_IN_FLIGHT);
	atomic_store(&g_state, SG_GPU_ON);
}

/* ------------------------------------------------------------------ per call */

uint32_t sg_gpu_begin(struct sg_ring_header *h, cudaStream_t stream, int *pair)
{
	cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
	uint32_t state = atomic_load_explicit(&g_state, memory_order_acquire);
	cudaError_t e;
	int dev, p;

	*pair = -1;
	if (__builtin_expect(state != SG_GPU_ON, 0)) {
		if (state != SG_GPU_UNTRIED)
			return SG_F_NO_EVENT;
		pthread_mutex_lock(&g_mu);
		if (atomic_load(&g_state) == SG_GPU_UNTRIED)
			gpu_init(h);
		pthread_mutex_unlock(&g_mu);
		if (atomic_load(&g_state) != SG_GPU_ON)
			return SG_F_NO_EVENT;
	}
	e = cu.st_capturing(stream, &st);
	if (e == cudaErrorStreamCaptureImplicit)
		return SG_F_CAPTURED; /* the legacy stream while another captures */
	if (e) {
		gpu_off(SG_GPU_CUDA_ERROR, e);
		return SG_F_NO_EVENT;
	}
	if (st != cudaStreamCaptureStatusNone)
		return SG_F_CAPTURED;
	if ((e = cu.get_device(&dev))) {
		gpu_off(SG_GPU_CUDA_ERROR, e);
		return SG_F_NO_EVENT;
	}
	if (dev != g_device)
		return SG_F_NO_EVENT; /* the pool's events belong to one device */
	pthread_mutex_lock(&g_mu);
	if (g_free < 0 && atomic_load(&g_state) == SG_GPU_ON && grow_pool() == 0 &&
	    atomic_load(&g_state) == SG_GPU_ON)
		gpu_off(SG_GPU_POOL, 0);
	p = g_free;
	if (p >= 0 && atomic_load(&g_state) == SG_GPU_ON) {
		g_free = g_pairs[p].next_free;
		/* a reference taken before the start event is recorded: its GPU
		 * time precedes the call's, elapsed times stay positive */
		g_pairs[p].ref = g_ref;
		if (g_ref >= 0)
			g_refs[g_ref].users++;
	} else {
		p = -1;
	}
	pthread_mutex_unlock(&g_mu);
	if (p < 0)
		return SG_F_NO_EVENT;
	if ((e = cu.ev_record(g_pairs[p].start, stream))) {
		pthread_mutex_lock(&g_mu);
		release_pair(p);
		pthread_mutex_unlock(&g_mu);
		gpu_off(SG_GPU_CUDA_ERROR, e);
		return SG_F_NO_EVENT;
	}
	*pair = p;
	return 0;
}

int sg_gpu_end(int pair, cudaStream_t stream)
{
	cudaError_t e = cu.ev_record(g_pairs[pair].end, stream);

	if (!e)
		return 0;
	pthread_mutex_lock(&g_mu);
	release_pair(pair);
	pthread_mutex_unlock(&g_mu);
	gpu_off(SG_GPU_CUDA_ERROR, e);
	return -1;
}

/* g_mu held: commit a pending record with host times only, GPU time lost */
static void finish_lost(struct pending *q)
{
	q->slot->flags |= SG_F_NO_EVENT;
	sg_ring_inflight_done(q->h); /* first: a reader that sees the record sees it done */
	sg_ring_commit(q->h, q->slot, q->n);
	atomic_fetch_add_explicit(&q->h->gpu_lost, 1, memory_order_relaxed);
	release_pair(q->pair);
	q->state = P_FINAL;
}

/* g_mu held: drop finished entries from the head of the FIFO */
static void trim(void)
{
	while (g_count && g_q[g_head].state == P_FINAL) {
		g_q[g_head].state = P_FREE;
		g_head = (g_head + 1) % (unsigned)g_max;
		g_count--;
	}
}

void sg_gpu_submit(struct sg_ring_header *h, struct sg_record *slot, uint64_t n, int pair,
		   cudaStream_t stream)
{
	struct pending *q;
	uint64_t lap = h->capacity / 2;
	uint32_t state;
	unsigned i;

	pthread_mutex_lock(&g_mu);
	/* a record still waiting when the ring is half a lap further would
	 * be overwritten under us: give its GPU time up (a hung collective).
	 * The FIFO is in submission order, so only its head can be that old. */
	for (i = 0; i < g_count; i++) {
		struct pending *o = &g_q[(g_head + i) % (unsigned)g_max];

		if (o->state != P_PENDING)
			continue;
		if (o->h != h || o->n + lap > n)
			break;
		finish_lost(o);
	}
	trim();
	state = atomic_load(&g_state);
	if (state == SG_GPU_CUDA_ERROR || state == SG_GPU_DISABLED || g_count == (unsigned)g_max) {
		/* a CUDA error since begin: these events say nothing; host times */
		slot->flags |= SG_F_NO_EVENT;
		sg_ring_commit(h, slot, n);
		release_pair(pair);
		pthread_mutex_unlock(&g_mu);
		return;
	}
	q = &g_q[(g_head + g_count) % (unsigned)g_max];
	g_count++;
	q->h = h;
	q->slot = slot;
	q->n = n;
	q->stream = stream;
	q->pair = pair;
	q->state = P_PENDING;
	/* in flight until committed, by finish or finish_lost */
	sg_ring_inflight_add(h, slot->start_ns);
	pthread_mutex_unlock(&g_mu);
}

/* ------------------------------------------------------------------ completion */

/* g_mu held: commit q with the GPU times found for it */
static void finish(struct pending *q, uint64_t gpu_start, uint64_t gpu_end)
{
	q->slot->gpu_start_ns = gpu_start;
	q->slot->gpu_end_ns = gpu_end >= gpu_start ? gpu_end : gpu_start;
	q->slot->flags |= SG_F_GPU_TIME;
	sg_ring_inflight_done(q->h);
	sg_ring_commit(q->h, q->slot, q->n);
	release_pair(q->pair);
	q->state = P_FINAL;
}

#define SNAP 256

struct snap {
	unsigned idx;
	int pair;
	cudaStream_t stream;
	cudaEvent_t ref, start, end;
	uint64_t ref_host;
	/* result */
	cudaError_t err;
	uint64_t gpu_start, gpu_end;
};

/*
 * One pass over (up to SNAP of) the pending records. The CUDA calls run
 * without g_mu, so a caller never waits on a query: the entries are copied
 * out, queried, and the results applied to those still pending with the
 * same pair (the ring-lap rule may have given one up meanwhile). Returns
 * how many remain in flight. at_exit: errors mean "the runtime is going
 * away", not "timing off".
 */
static unsigned poll_once(int at_exit)
{
	static struct snap sn[SNAP]; /* the completion thread, or exit with it parked */
	cudaStream_t blocked[8];
	unsigned i, k, n = 0, nb = 0, left = 0;
	int fatal = 0;
	cudaError_t fatal_err = cudaSuccess;

	pthread_mutex_lock(&g_mu);
	for (i = 0; i < g_count && n < SNAP; i++) {
		unsigned idx = (g_head + i) % (unsigned)g_max;
		struct pending *q = &g_q[idx];
		int ref;

		if (q->state != P_PENDING)
			continue;
		ref = g_pairs[q->pair].ref;
		if (ref < 0) {
			finish_lost(q); /* no reference could be made */
			continue;
		}
		sn[n].idx = idx;
		sn[n].pair = q->pair;
		sn[n].stream = q->stream;
		sn[n].ref = g_refs[ref].ev;
		sn[n].ref_host = g_refs[ref].host_ns;
		sn[n].start = g_pairs[q->pair].start;
		sn[n].end = g_pairs[q->pair].end;
		n++;
	}
	pthread_mutex_unlock(&g_mu);

	for (i = 0; i < n; i++) {
		struct snap *p = &sn[i];
		float ms0 = 0, ms1 = 0;

		p->err = cudaErrorNotReady;
		if (!at_exit && atomic_load_explicit(&g_stopping, memory_order_relaxed))
			continue;
		/* a stream runs in order: behind a pending event, later ones on
		 * that stream are pending too */
		for (k = 0; k < nb && blocked[k] != p->stream; k++)
			;
		if (k < nb)
			continue;
		/* the end's elapsed time is also its readiness test
		 * (cudaErrorNotReady while pending): two runtime calls a record,
		 * not a query and two, so fewer turns at the driver's locks that
		 * the job's threads take to enqueue; a done end means a done start
		 * (same stream, recorded before it) */
		p->err = cu.ev_elapsed(&ms1, p->ref, p->end);
		if (p->err == cudaSuccess)
			p->err = cu.ev_elapsed(&ms0, p->ref, p->start);
		if (p->err == cudaSuccess) {
			p->gpu_start = p->ref_host + (uint64_t)((int64_t)((double)ms0 * 1e6));
			p->gpu_end = p->ref_host + (uint64_t)((int64_t)((double)ms1 * 1e6));
		} else if (p->err == cudaErrorNotReady && nb < 8) {
			blocked[nb++] = p->stream;
		}
	}

	pthread_mutex_lock(&g_mu);
	for (i = 0; i < n; i++) {
		struct snap *p = &sn[i];
		struct pending *q = &g_q[p->idx];

		if (q->state != P_PENDING || q->pair != p->pair)
			continue;
		if (p->err == cudaSuccess) {
			finish(q, p->gpu_start, p->gpu_end);
		} else if (p->err == cudaErrorNotReady) {
			left++;
		} else if (at_exit) {
			finish_lost(q);
		} else if (!fatal) {
			fatal = 1;
			fatal_err = p->err;
		}
	}
	if (fatal) {
		/* a CUDA error: timing off, everything in flight keeps host times */
		gpu_off(SG_GPU_CUDA_ERROR, fatal_err);
		for (i = 0; i < g_count; i++) {
			struct pending *q = &g_q[(g_head + i) % (unsigned)g_max];

			if (q->state == P_PENDING)
				finish_lost(q);
		}
		left = 0;
	}
	trim();
	if (!fatal)
		left += g_count > n ? 1 : 0; /* more beyond this pass */
	pthread_mutex_unlock(&g_mu);
	return left;
}

static void *completion_thread(void *arg)
{
	cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
	struct timespec busy = { 0, 100000 }, idle = { 0, 2000000 };

	(void)arg;
	/* this thread's queries must never invalidate a global-mode capture
	 * in the job's threads */
	if (cu.exch_mode(&mode) || cu.set_device(g_device)) {
		gpu_off(SG_GPU_CUDA_ERROR, cudaErrorInitializationError);
		poll_once(1);
	}
	while (!atomic_load(&g_stopping)) {
		unsigned left = poll_once(0);
		uint32_t state = atomic_load(&g_state);

		pthread_mutex_lock(&g_mu);
		if (state == SG_GPU_ON && mono() - g_ref_time > RECAL_NS &&
		    !atomic_load(&g_stopping))
			calibrate();
		pthread_mutex_unlock(&g_mu);
		if (state == SG_GPU_CUDA_ERROR)
			break; /* everything in flight was given up: done */
		nanosleep(left ? &busy : &idle, NULL);
	}
	atomic_store(&g_parked, 1);
	return NULL;
}

static void gpu_atexit(void)
{
	cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
	struct timespec nap = { 0, 200000 };
	int i;

	atomic_store(&g_stopping, 1);
	/* the thread leaves its loop between two CUDA calls; 20 ms at most */
	for (i = 0; i < 100 && atomic_load(&g_thread_running) && !atomic_load(&g_parked); i++)
		nanosleep(&nap, NULL);
	if (!atomic_load(&g_parked) && atomic_load(&g_state) == SG_GPU_ON)
		return; /* stuck in the runtime: leave the records uncommitted */
	if (pthread_mutex_trylock(&g_mu) != 0)
		return;
	if (g_count) {
		cu.exch_mode(&mode);
		pthread_mutex_unlock(&g_mu);
		poll_once(1); /* done ones get their GPU times */
		pthread_mutex_lock(&g_mu);
		for (i = 0; (unsigned)i < g_count; i++) {
			struct pending *q = &g_q[(g_head + (unsigned)i) % (unsigned)g_max];

			if (q->state == P_PENDING)
				finish_lost(q);
		}
		trim();
	}
	pthread_mutex_unlock(&g_mu);
}

void sg_gpu_after_fork(void)
{
	pthread_mutex_init(&g_mu, NULL);
	g_count = 0;
	g_head = 0;
	atomic_store(&g_thread_running, 0);
	g_h = NULL;
	/* a parent that never timed a call leaves the child free to start;
	 * after the parent used CUDA the child cannot (and must not commit the
	 * parent's records) */
	if (atomic_load(&g_state) != SG_GPU_UNTRIED)
		atomic_store(&g_state, SG_GPU_DISABLED);
}
