/*
 * sg_clock.h - CLOCK_MONOTONIC nanoseconds for the hook's hot path.
 *
 * Two timestamps are most of the hook's cost, so where the kernel itself
 * keeps time with the TSC (clocksource "tsc": invariant and synchronised
 * across CPUs) the hook reads the TSC and maps it to CLOCK_MONOTONIC ns:
 *
 *   ns = ns_base + ((tsc - tsc_base) * mult) >> 32
 *
 * The mapping is re-anchored to clock_gettime about once a second with
 * mult measured over the whole time since the first anchor, so the result
 * tracks CLOCK_MONOTONIC (NTP slewing included) to within microseconds and
 * timestamps stay comparable with other processes and nodes' agents.
 * Elsewhere (other clocksources, other CPUs, SLURMGUARD_HOOK_CLOCK=monotonic)
 * it is plain clock_gettime(CLOCK_MONOTONIC).
 *
 * The anchor is a seqlock-protected pair of slots: readers never block;
 * one thread at a time re-anchors (try-lock), the others keep the old one.
 */
#ifndef SG_CLOCK_H
#define SG_CLOCK_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <x86intrin.h>
#define SG_HAVE_TSC 1
#else
#define SG_HAVE_TSC 0
#endif

struct sg_clock_anchor {
	uint64_t tsc_base;
	uint64_t ns_base;
	uint64_t mult;  /* ns per tick, 32.32 fixed point */
	uint64_t limit; /* re-anchor once tsc - tsc_base exceeds this */
};

struct sg_clock {
	_Atomic int mode;  /* 0 = not set up, 1 = clock_gettime, 2 = tsc */
	_Atomic unsigned seq; /* odd while an anchor is rewritten */
	_Atomic int busy;  /* a thread is re-anchoring */
	struct sg_clock_anchor a;
	uint64_t tsc0, ns0; /* first anchor: mult is measured from here */
};

static inline uint64_t sg_clock_mono(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#if SG_HAVE_TSC
/* A (tsc, ns) pair read as close together as the machine allows: the
 * tightest bracket of a few tries, ns read in its middle. */
static inline void sg_clock_pair(uint64_t *tsc, uint64_t *ns)
{
	uint64_t best = UINT64_MAX;
	int i;

	*tsc = __rdtsc();
	*ns = sg_clock_mono();
	for (i = 0; i < 5; i++) {
		uint64_t t0 = __rdtsc();
		uint64_t n = sg_clock_mono();
		uint64_t t1 = __rdtsc();

		if (t1 - t0 < best) {
			best = t1 - t0;
			*tsc = t0 + (t1 - t0) / 2;
			*ns = n;
		}
	}
}

static int sg_clock_tsc_usable(void)
{
	const char *force = getenv("SLURMGUARD_HOOK_CLOCK");
	char src[32] = "";
	FILE *f;

	if (force && strcmp(force, "monotonic") == 0)
		return 0;
	f = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "re");
	if (!f)
		return 0;
	if (!fgets(src, sizeof(src), f))
		src[0] = '\0';
	fclose(f);
	return strncmp(src, "tsc", 3) == 0 && (src[3] == '\n' || src[3] == '\0');
}

static void sg_clock_store(struct sg_clock *c, const struct sg_clock_anchor *a)
{
	atomic_fetch_add_explicit(&c->seq, 1, memory_order_relaxed);
	atomic_thread_fence(memory_order_release);
	c->a = *a;
	atomic_fetch_add_explicit(&c->seq, 1, memory_order_release);
}

static void __attribute__((noinline)) sg_clock_reanchor(struct sg_clock *c)
{
	struct sg_clock_anchor a;
	uint64_t tsc = 0, ns = 0;
	int expected = 0;

	if (!atomic_compare_exchange_strong(&c->busy, &expected, 1))
		return;
	sg_clock_pair(&tsc, &ns);
	if (tsc > c->tsc0 && ns > c->ns0) {
		a.tsc_base = tsc;
		a.ns_base = ns;
		a.mult = (uint64_t)(((unsigned __int128)(ns - c->ns0) << 32) / (tsc - c->tsc0));
		a.limit = c->a.limit;
		sg_clock_store(c, &a);
	}
	atomic_store(&c->busy, 0);
}
#endif

/* Decide the mode; with the TSC, calibrate over ~2 ms. Call once before use
 * (the hook does it when it creates the ring). */
static void sg_clock_setup(struct sg_clock *c)
{
#if SG_HAVE_TSC
	if (sg_clock_tsc_usable()) {
		struct sg_clock_anchor a;
		uint64_t t1 = 0, n1 = 0;

		sg_clock_pair(&c->tsc0, &c->ns0);
		do {
			sg_clock_pair(&t1, &n1);
		} while (n1 - c->ns0 < 2000000ull);
		a.tsc_base = t1;
		a.ns_base = n1;
		a.mult = (uint64_t)(((unsigned __int128)(n1 - c->ns0) << 32) / (t1 - c->tsc0));
		/* about one second of ticks */
		a.limit = (uint64_t)(((unsigned __int128)1000000000ull << 32) / (a.mult ? a.mult : 1));
		sg_clock_store(c, &a);
		atomic_store(&c->mode, 2);
		return;
	}
#endif
	atomic_store(&c->mode, 1);
}

/* A raw reading: TSC ticks in tsc mode, else CLOCK_MONOTONIC ns. Taking
 * raw readings around a call and converting both afterwards with one anchor
 * read keeps the conversion off the timed section. */
static inline uint64_t sg_clock_raw(struct sg_clock *c)
{
#if SG_HAVE_TSC
	if (__builtin_expect(atomic_load_explicit(&c->mode, memory_order_relaxed) == 2, 1))
		return __rdtsc();
#else
	(void)c;
#endif
	return sg_clock_mono();
}

#if SG_HAVE_TSC
static inline void sg_clock_anchor_read(struct sg_clock *c, struct sg_clock_anchor *a)
{
	unsigned s1, s2;

	do {
		s1 = atomic_load_explicit(&c->seq, memory_order_acquire);
		*a = c->a;
		atomic_thread_fence(memory_order_acquire);
		s2 = atomic_load_explicit(&c->seq, memory_order_relaxed);
	} while (__builtin_expect((s1 & 1) || s1 != s2, 0));
}

static inline uint64_t sg_clock_apply(const struct sg_clock_anchor *a, uint64_t raw)
{
	/* signed: another thread may have re-anchored after raw was read */
	int64_t d = (int64_t)(raw - a->tsc_base);

	return a->ns_base + (uint64_t)(((__int128)d * (__int128)a->mult) >> 32);
}
#endif

/* Convert two raw readings (r0 <= r1 in time) to CLOCK_MONOTONIC ns. */
static inline void sg_clock_ns2(struct sg_clock *c, uint64_t r0, uint64_t r1, uint64_t *t0,
				uint64_t *t1)
{
#if SG_HAVE_TSC
	if (__builtin_expect(atomic_load_explicit(&c->mode, memory_order_relaxed) == 2, 1)) {
		struct sg_clock_anchor a;

		sg_clock_anchor_read(c, &a);
		if (__builtin_expect(r1 - a.tsc_base > a.limit && r1 > a.tsc_base, 0)) {
			sg_clock_reanchor(c);
			sg_clock_anchor_read(c, &a);
		}
		*t0 = sg_clock_apply(&a, r0);
		*t1 = sg_clock_apply(&a, r1);
		return;
	}
#else
	(void)c;
#endif
	*t0 = r0;
	*t1 = r1;
}

static inline uint64_t sg_clock_now(struct sg_clock *c)
{
	uint64_t r = sg_clock_raw(c), t, unused;

	sg_clock_ns2(c, r, r, &t, &unused);
	return t;
}

#endif /* SG_CLOCK_H */
