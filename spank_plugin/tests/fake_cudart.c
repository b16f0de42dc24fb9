/*
 * fake_cudart.c - a stand-in for libcudart.so.12 on machines without a GPU,
 * for testing the NCCL hook's CUDA-event timing. It models what the hook
 * depends on, as the CUDA Runtime API reference documents it:
 *
 *  - streams run their queued work in order, asynchronously: each stream
 *    has a worker thread ("the GPU") that executes kernels (a programmable
 *    duration, then an optional host function) and event records; launches
 *    and cudaEventRecord return at once;
 *  - events: cudaEventQuery returns cudaErrorNotReady until the stream
 *    reaches the record (cudaSuccess for a never-recorded event);
 *    cudaEventElapsedTime returns ms with ~0.5 us resolution,
 *    cudaErrorInvalidResourceHandle for unrecorded / DisableTiming / NULL
 *    events, cudaErrorNotReady while either is pending; an event recorded
 *    in a capturing stream answers cudaErrorCapturedEvent; an event and a
 *    stream of different devices: cudaErrorInvalidResourceHandle;
 *  - stream capture: cudaStreamBeginCapture/EndCapture/IsCapturing; work
 *    launched into a capturing stream becomes a graph node and does not
 *    run; in cudaStreamCaptureModeGlobal, "potentially unsafe" calls
 *    (cudaEventQuery, cudaEventSynchronize, cudaStreamQuery,
 *    cudaStreamSynchronize, cudaDeviceSynchronize) from a thread whose mode
 *    is not relaxed return cudaErrorStreamCaptureUnsupported and invalidate
 *    the capture (EndCapture then returns cudaErrorStreamCaptureInvalidated);
 *    cudaThreadExchangeStreamCaptureMode sets the calling thread's mode;
 *    using the legacy stream while a blocking stream captures returns
 *    cudaErrorStreamCaptureImplicit and invalidates the capture;
 *  - the special handles NULL / cudaStreamLegacy / cudaStreamPerThread are
 *    the current device's default stream (one per device, FAKE_CUDA_DEVICES
 *    devices, default 2);
 *  - after the library's destructor ran (process exit), every call returns
 *    cudaErrorCudartUnloading.
 *
 * Test controls (not CUDA API): fakeCudaLaunch (a kernel of N ns),
 * fakeCudaFail (make a function fail, stickily, as after a device fault),
 * fakeCudaCalls (how often a function was called), fakeCudaGraphNodes,
 * fakeCudaInvalidated (captures invalidated so far).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../cuda_api.h"

#define MAX_DEV 8
#define EV_MAGIC 0x45564e54u
#define ST_MAGIC 0x5354524du

struct item {
	int kind; /* 0 kernel, 1 event record */
	uint64_t ns;
	void (*fn)(void *);
	void *arg;
	struct CUevent_st *ev;
	uint64_t gen;
	struct item *next;
};

struct CUgraph_st {
	unsigned nodes;
};

struct CUstream_st {
	unsigned magic;
	unsigned flags;
	int device;
	int destroyed;
	struct item *head, *tail;
	uint64_t queued, done;
	pthread_cond_t cond;
	pthread_t worker;
	int started;
	/* capture */
	cudaStreamCaptureStatus capture;
	cudaStreamCaptureMode capture_mode;
	struct CUgraph_st *graph;
	unsigned base_global, base_legacy; /* invalidation counters at begin */
	int self_invalid;
};

struct CUevent_st {
	unsigned magic;
	unsigned flags;
	int device;
	int recorded, captured;
	uint64_t gen, done_gen;
	uint64_t t_ns;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cond = PTHREAD_COND_INITIALIZER;
static struct CUstream_st default_streams[MAX_DEV];
static int ndev = -1;
static int unloading;
static unsigned global_captures, blocking_captures;
/* bumped when an unsafe call (inval_global) or a use of the legacy stream
 * (inval_legacy) invalidates the captures running at that moment */
static unsigned inval_global, inval_legacy, invalidated;
static __thread int tls_device;
static __thread cudaStreamCaptureMode tls_mode = cudaStreamCaptureModeGlobal;

/* ------------------------------------------------------------------ controls */

enum {
	C_EVCREATE, C_EVCREATEF, C_EVDESTROY, C_EVRECORD, C_EVQUERY, C_EVSYNC, C_EVELAPSED,
	C_STCREATE, C_STCREATEF, C_STDESTROY, C_STSYNC, C_STQUERY, C_STCAPTURING,
	C_BEGINCAP, C_ENDCAP, C_EXCHMODE, C_GETDEV, C_SETDEV, C_DEVCOUNT, C_DEVSYNC, C_NFUNCS
};
static const char *const names[C_NFUNCS] = {
	"cudaEventCreate", "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaEventRecord",
	"cudaEventQuery", "cudaEventSynchronize", "cudaEventElapsedTime", "cudaStreamCreate",
	"cudaStreamCreateWithFlags", "cudaStreamDestroy", "cudaStreamSynchronize",
	"cudaStreamQuery", "cudaStreamIsCapturing", "cudaStreamBeginCapture",
	"cudaStreamEndCapture", "cudaThreadExchangeStreamCaptureMode", "cudaGetDevice",
	"cudaSetDevice", "cudaGetDeviceCount", "cudaDeviceSynchronize",
};
static unsigned long long ncalls[C_NFUNCS];
static cudaError_t fail_err[C_NFUNCS];
static long fail_after[C_NFUNCS];

unsigned long long fakeCudaCalls(const char *name)
{
	unsigned long long n = 0;
	int i;

	pthread_mutex_lock(&mu);
	for (i = 0; i < C_NFUNCS; i++)
		if (!name || strcmp(name, names[i]) == 0)
			n += ncalls[i];
	pthread_mutex_unlock(&mu);
	return n;
}

/* From the (after+1)-th call on, `name` returns err (sticky, like the
 * errors a device fault leaves behind). err 0 clears. */
void fakeCudaFail(const char *name, cudaError_t err, long after)
{
	int i;

	pthread_mutex_lock(&mu);
	for (i = 0; i < C_NFUNCS; i++) {
		if (strcmp(name, names[i]) == 0) {
			fail_err[i] = err;
			fail_after[i] = after;
		}
	}
	pthread_mutex_unlock(&mu);
}

unsigned fakeCudaGraphNodes(cudaGraph_t g)
{
	return g ? g->nodes : 0;
}

unsigned fakeCudaInvalidated(void)
{
	return invalidated;
}

/* called with mu held: counts the call, returns an injected error or 0 */
static cudaError_t enter(int f)
{
	ncalls[f]++;
	if (unloading)
		return cudaErrorCudartUnloading;
	if (fail_err[f]) {
		if (fail_after[f] > 0)
			fail_after[f]--;
		else
			return fail_err[f];
	}
	return cudaSuccess;
}

/* the same, for calls that touch no shared state after it */
static cudaError_t enter_locked(int f)
{
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(f);
	pthread_mutex_unlock(&mu);
	return e;
}

/* a convenience entry point (cudaStreamCreate, cudaEventCreate): counted
 * as itself, then the full call does the rest */
static void count_only(int f)
{
	pthread_mutex_lock(&mu);
	ncalls[f]++;
	pthread_mutex_unlock(&mu);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ streams */

static void *worker(void *p)
{
	struct CUstream_st *s = p;

	pthread_mutex_lock(&mu);
	for (;;) {
		struct item *it;

		while (!s->head && !s->destroyed)
			pthread_cond_wait(&s->cond, &mu);
		if (!s->head)
			break;
		it = s->head;
		s->head = it->next;
		if (!s->head)
			s->tail = NULL;
		if (it->kind == 0) {
			struct timespec until;
			uint64_t end;

			pthread_mutex_unlock(&mu);
			/* fn first: a collective waits for its peers, then moves data */
			if (it->fn)
				it->fn(it->arg);
			end = now_ns() + it->ns;
			until.tv_sec = (time_t)(end / 1000000000ull);
			until.tv_nsec = (long)(end % 1000000000ull);
			while (it->ns && clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) ==
						 EINTR)
				;
			pthread_mutex_lock(&mu);
		} else if (it->ev->gen == it->gen) {
			/* a re-record before the stream got here supersedes this one */
			it->ev->t_ns = now_ns();
			it->ev->done_gen = it->gen;
		}
		s->done++;
		free(it);
		pthread_cond_broadcast(&done_cond);
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

static void stream_init(struct CUstream_st *s, unsigned flags, int device)
{
	memset(s, 0, sizeof(*s));
	s->magic = ST_MAGIC;
	s->flags = flags;
	s->device = device;
	pthread_cond_init(&s->cond, NULL);
}

static int devices(void)
{
	if (ndev < 0) {
		const char *v = getenv("FAKE_CUDA_DEVICES");

		ndev = v ? atoi(v) : 2;
		if (ndev < 0 || ndev > MAX_DEV)
			ndev = 2;
	}
	return ndev;
}

/* mu held. NULL for a bad handle. */
static struct CUstream_st *resolve(cudaStream_t h)
{
	struct CUstream_st *s;

	if (h == NULL || h == cudaStreamLegacy || h == cudaStreamPerThread) {
		s = &default_streams[tls_device];
		if (s->magic != ST_MAGIC)
			stream_init(s, cudaStreamDefault, tls_device);
		return s;
	}
	s = (struct CUstream_st *)h;
	return s->magic == ST_MAGIC && !s->destroyed ? s : NULL;
}

static int is_legacy(cudaStream_t h)
{
	return h == NULL || h == cudaStreamLegacy;
}

/* mu held: may the calling thread make a potentially unsafe call now? */
static cudaError_t unsafe_check(void)
{
	if (tls_mode != cudaStreamCaptureModeRelaxed && global_captures) {
		inval_global++;
		invalidated++;
		return cudaErrorStreamCaptureUnsupported;
	}
	return cudaSuccess;
}

/* mu held: the legacy stream may not be used while a blocking stream captures */
static cudaError_t legacy_check(cudaStream_t h)
{
	if (is_legacy(h) && blocking_captures) {
		inval_legacy++;
		invalidated++;
		return cudaErrorStreamCaptureImplicit;
	}
	return cudaSuccess;
}

static void enqueue(struct CUstream_st *s, struct item *it)
{
	if (!s->started) {
		pthread_attr_t a;

		pthread_attr_init(&a);
		pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
		pthread_create(&s->worker, &a, worker, s);
		pthread_attr_destroy(&a);
		s->started = 1;
	}
	it->next = NULL;
	if (s->tail)
		s->tail->next = it;
	else
		s->head = it;
	s->tail = it;
	s->queued++;
	pthread_cond_signal(&s->cond);
}

/* Test control: a kernel that calls fn(arg) on "the GPU" (the stream's
 * worker; fn may block, e.g. waiting for peers), then runs for ns
 * nanoseconds. In a capturing stream it becomes a graph node and does not
 * run. */
cudaError_t fakeCudaLaunch(cudaStream_t stream, uint64_t ns, void (*fn)(void *), void *arg)
{
	struct CUstream_st *s;
	struct item *it;
	cudaError_t e = cudaSuccess;

	pthread_mutex_lock(&mu);
	if (unloading)
		e = cudaErrorCudartUnloading;
	else if (!(s = resolve(stream)))
		e = cudaErrorInvalidResourceHandle;
	else if ((e = legacy_check(stream)) != cudaSuccess)
		;
	else if (s->capture == cudaStreamCaptureStatusActive)
		s->graph->nodes++;
	else if (!(it = calloc(1, sizeof(*it))))
		e = cudaErrorMemoryAllocation;
	else {
		it->kind = 0;
		it->ns = ns;
		it->fn = fn;
		it->arg = arg;
		enqueue(s, it);
	}
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned flags)
{
	struct CUstream_st *s;
	cudaError_t e;

	if ((e = enter_locked(C_STCREATEF)))
		return e;
	if (!out || flags > cudaStreamNonBlocking)
		return cudaErrorInvalidValue;
	if (!(s = malloc(sizeof(*s))))
		return cudaErrorMemoryAllocation;
	stream_init(s, flags, tls_device);
	*out = s;
	return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *out)
{
	count_only(C_STCREATE);
	return cudaStreamCreateWithFlags(out, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t h)
{
	struct CUstream_st *s;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(C_STDESTROY);
	if (!e && (is_legacy(h) || h == cudaStreamPerThread || !(s = resolve(h))))
		e = cudaErrorInvalidResourceHandle;
	if (!e) {
		/* returns at once; queued work still runs (the worker leaves
		 * when the queue is empty; the handle is never reused) */
		s->destroyed = 1;
		pthread_cond_signal(&s->cond);
	}
	pthread_mutex_unlock(&mu);
	return e;
}

static cudaError_t stream_sync(struct CUstream_st *s)
{
	while (s->done < s->queued && !unloading)
		pthread_cond_wait(&done_cond, &mu);
	return cudaSuccess;
}

/* mu held: what the stream waits and queries check first (a wait on the
 * legacy stream also while another thread captures in a blocking stream) */
static cudaError_t st_wait_check(int f, cudaStream_t h, int wait, struct CUstream_st **out)
{
	cudaError_t e = enter(f);

	if (!e)
		e = unsafe_check();
	if (!e && wait)
		e = legacy_check(h);
	if (!e && !(*out = resolve(h)))
		e = cudaErrorInvalidResourceHandle;
	return e;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h)
{
	struct CUstream_st *s = NULL;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = st_wait_check(C_STSYNC, h, 1, &s);
	if (!e && s->capture != cudaStreamCaptureStatusNone) {
		s->self_invalid = 1;
		invalidated++;
		e = cudaErrorStreamCaptureUnsupported;
	}
	if (!e)
		e = stream_sync(s);
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaStreamQuery(cudaStream_t h)
{
	struct CUstream_st *s = NULL;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = st_wait_check(C_STQUERY, h, 0, &s);
	if (!e)
		e = s->done < s->queued ? cudaErrorNotReady : cudaSuccess;
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaDeviceSynchronize(void)
{
	cudaError_t e;
	int d;

	pthread_mutex_lock(&mu);
	e = enter(C_DEVSYNC);
	if (!e)
		e = unsafe_check();
	for (d = 0; !e && d < MAX_DEV; d++)
		if (default_streams[d].magic == ST_MAGIC)
			stream_sync(&default_streams[d]);
	pthread_mutex_unlock(&mu);
	return e;
}

static int capture_invalid(const struct CUstream_st *s)
{
	return s->self_invalid ||
	       (s->capture_mode == cudaStreamCaptureModeGlobal && inval_global != s->base_global) ||
	       (!(s->flags & cudaStreamNonBlocking) && inval_legacy != s->base_legacy);
}

cudaError_t cudaStreamBeginCapture(cudaStream_t h, cudaStreamCaptureMode mode)
{
	struct CUstream_st *s;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(C_BEGINCAP);
	if (!e && (is_legacy(h) || (unsigned)mode > cudaStreamCaptureModeRelaxed))
		e = cudaErrorStreamCaptureUnsupported;
	if (!e && !(s = resolve(h)))
		e = cudaErrorInvalidResourceHandle;
	if (!e && s->capture != cudaStreamCaptureStatusNone)
		e = cudaErrorInvalidValue;
	if (!e && !(s->graph = calloc(1, sizeof(*s->graph))))
		e = cudaErrorMemoryAllocation;
	if (!e) {
		s->capture = cudaStreamCaptureStatusActive;
		s->capture_mode = mode;
		s->self_invalid = 0;
		s->base_global = inval_global;
		s->base_legacy = inval_legacy;
		if (mode == cudaStreamCaptureModeGlobal)
			global_captures++;
		if (!(s->flags & cudaStreamNonBlocking))
			blocking_captures++;
	}
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaStreamEndCapture(cudaStream_t h, cudaGraph_t *graph)
{
	struct CUstream_st *s;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(C_ENDCAP);
	if (!e && (!graph || !(s = resolve(h))))
		e = cudaErrorInvalidValue;
	if (!e && s->capture == cudaStreamCaptureStatusNone)
		e = cudaErrorInvalidValue;
	if (!e) {
		int bad = capture_invalid(s);

		if (s->capture_mode == cudaStreamCaptureModeGlobal)
			global_captures--;
		if (!(s->flags & cudaStreamNonBlocking))
			blocking_captures--;
		s->capture = cudaStreamCaptureStatusNone;
		if (bad) {
			free(s->graph);
			*graph = NULL;
			e = cudaErrorStreamCaptureInvalidated;
		} else {
			*graph = s->graph;
		}
		s->graph = NULL;
	}
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g)
{
	free(g);
	return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t h, cudaStreamCaptureStatus *status)
{
	struct CUstream_st *s;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(C_STCAPTURING);
	if (!e && !status)
		e = cudaErrorInvalidValue;
	if (!e && is_legacy(h) && blocking_captures)
		e = cudaErrorStreamCaptureImplicit;
	if (!e && !(s = resolve(h)))
		e = cudaErrorInvalidResourceHandle;
	if (!e)
		*status = s->capture == cudaStreamCaptureStatusNone ? cudaStreamCaptureStatusNone :
			  capture_invalid(s) ? cudaStreamCaptureStatusInvalidated :
					       cudaStreamCaptureStatusActive;
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode *mode)
{
	cudaStreamCaptureMode old;
	cudaError_t e;

	if ((e = enter_locked(C_EXCHMODE)))
		return e;
	if (!mode || (unsigned)*mode > cudaStreamCaptureModeRelaxed)
		return cudaErrorInvalidValue;
	old = tls_mode;
	tls_mode = *mode;
	*mode = old;
	return cudaSuccess;
}

/* ------------------------------------------------------------------ events */

static struct CUevent_st *ev_ok(cudaEvent_t h)
{
	return h && h->magic == EV_MAGIC ? h : NULL;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned flags)
{
	struct CUevent_st *ev;
	cudaError_t e;

	if ((e = enter_locked(C_EVCREATEF)))
		return e;
	if (!out || (flags & ~0x7u))
		return cudaErrorInvalidValue;
	if (!(ev = calloc(1, sizeof(*ev))))
		return cudaErrorMemoryAllocation;
	ev->magic = EV_MAGIC;
	ev->flags = flags;
	ev->device = tls_device;
	*out = ev;
	return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *out)
{
	count_only(C_EVCREATE);
	return cudaEventCreateWithFlags(out, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t h)
{
	struct CUevent_st *ev;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(C_EVDESTROY);
	if (!e && !(ev = ev_ok(h)))
		e = cudaErrorInvalidResourceHandle;
	/* a pending record still refers to it: keep the memory, kill the handle */
	if (!e)
		ev->magic = 0;
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t stream)
{
	struct CUevent_st *ev;
	struct CUstream_st *s;
	struct item *it;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(C_EVRECORD);
	if (!e && !(ev = ev_ok(h)))
		e = cudaErrorInvalidResourceHandle;
	if (!e)
		e = legacy_check(stream);
	if (!e && !(s = resolve(stream)))
		e = cudaErrorInvalidResourceHandle;
	if (!e && s->device != ev->device)
		e = cudaErrorInvalidResourceHandle;
	if (!e && s->capture == cudaStreamCaptureStatusActive) {
		/* a captured record: a dependency marker inside the graph */
		ev->recorded = 1;
		ev->captured = 1;
		ev->gen++;
	} else if (!e && !(it = calloc(1, sizeof(*it)))) {
		e = cudaErrorMemoryAllocation;
	} else if (!e) {
		ev->recorded = 1;
		ev->captured = 0;
		it->kind = 1;
		it->ev = ev;
		it->gen = ++ev->gen;
		enqueue(s, it);
	}
	pthread_mutex_unlock(&mu);
	return e;
}

/* mu held: what cudaEventQuery and cudaEventSynchronize check first */
static cudaError_t ev_wait_check(int f, cudaEvent_t h, struct CUevent_st **out)
{
	cudaError_t e = enter(f);

	if (!e)
		e = unsafe_check();
	if (!e && !(*out = ev_ok(h)))
		e = cudaErrorInvalidResourceHandle;
	if (!e && (*out)->captured)
		e = cudaErrorCapturedEvent;
	return e;
}

cudaError_t cudaEventQuery(cudaEvent_t h)
{
	struct CUevent_st *ev = NULL;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = ev_wait_check(C_EVQUERY, h, &ev);
	if (!e && ev->recorded && ev->done_gen != ev->gen)
		e = cudaErrorNotReady;
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaEventSynchronize(cudaEvent_t h)
{
	struct CUevent_st *ev = NULL;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = ev_wait_check(C_EVSYNC, h, &ev);
	while (!e && ev->recorded && ev->done_gen != ev->gen && !unloading)
		pthread_cond_wait(&done_cond, &mu);
	pthread_mutex_unlock(&mu);
	return e;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
	struct CUevent_st *ea, *eb;
	cudaError_t e;

	pthread_mutex_lock(&mu);
	e = enter(C_EVELAPSED);
	if (!e && !ms)
		e = cudaErrorInvalidValue;
	if (!e && (!(ea = ev_ok(a)) || !(eb = ev_ok(b))))
		e = cudaErrorInvalidResourceHandle;
	if (!e && ((ea->flags | eb->flags) & cudaEventDisableTiming))
		e = cudaErrorInvalidResourceHandle;
	if (!e && (!ea->recorded || !eb->recorded))
		e = cudaErrorInvalidResourceHandle;
	if (!e && (ea->captured || eb->captured))
		e = cudaErrorCapturedEvent;
	if (!e && (ea->done_gen != ea->gen || eb->done_gen != eb->gen))
		e = cudaErrorNotReady;
	if (!e) {
		/* the GPU timer's ~0.5 us resolution */
		int64_t d = (int64_t)(eb->t_ns - ea->t_ns);
		int64_t q = (d >= 0 ? d + 250 : d - 250) / 500 * 500;

		*ms = (float)((double)q / 1e6);
	}
	pthread_mutex_unlock(&mu);
	return e;
}

/* ------------------------------------------------------------------ devices */

cudaError_t cudaGetDeviceCount(int *n)
{
	cudaError_t e;

	if ((e = enter_locked(C_DEVCOUNT)))
		return e;
	if (!n)
		return cudaErrorInvalidValue;
	*n = devices();
	return devices() ? cudaSuccess : cudaErrorNoDevice;
}

cudaError_t cudaGetDevice(int *d)
{
	cudaError_t e;

	if ((e = enter_locked(C_GETDEV)))
		return e;
	if (!d)
		return cudaErrorInvalidValue;
	*d = tls_device;
	return cudaSuccess;
}

cudaError_t cudaSetDevice(int d)
{
	cudaError_t e;

	if ((e = enter_locked(C_SETDEV)))
		return e;
	if (d < 0 || d >= devices())
		return cudaErrorInvalidDevice;
	tls_device = d;
	return cudaSuccess;
}

__attribute__((destructor)) static void fake_unload(void)
{
	pthread_mutex_lock(&mu);
	unloading = 1;
	pthread_cond_broadcast(&done_cond);
	pthread_mutex_unlock(&mu);
}
