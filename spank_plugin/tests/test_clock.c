/*
 * test_clock.c - the hook's clock (sg_clock.h) against CLOCK_MONOTONIC:
 * every reading lies within its clock_gettime bracket (give or take a few
 * microseconds) over 1.5 s, across re-anchors, in both modes.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <time.h>

#include "../sg_clock.h"
#include "check.h"

static void run(const char *label)
{
	static struct sg_clock c;
	uint64_t start, worst = 0, backwards = 0, prev = 0, n = 0;
	const uint64_t slack = 20000; /* ns */

	memset(&c, 0, sizeof(c));
	sg_clock_setup(&c);
	start = sg_clock_mono();
	while (sg_clock_mono() - start < 1500000000ull) {
		uint64_t lo = sg_clock_mono();
		uint64_t t = sg_clock_now(&c);
		uint64_t hi = sg_clock_mono();
		uint64_t err = t < lo ? lo - t : t > hi ? t - hi : 0;

		if (err > worst)
			worst = err;
		if (t < prev)
			backwards = prev - t > backwards ? prev - t : backwards;
		prev = t;
		n++;
		if (n % 1000 == 0) {
			struct timespec nap = { 0, 200000 };

			nanosleep(&nap, NULL);
		}
	}
	printf("test_clock: %s mode %d: %llu readings, worst error %llu ns, worst step back %llu ns\n",
	       label, atomic_load(&c.mode), (unsigned long long)n, (unsigned long long)worst,
	       (unsigned long long)backwards);
	CHECK(worst <= slack, "%s: reading %llu ns outside its bracket", label,
	      (unsigned long long)worst);
	CHECK(backwards <= slack, "%s: went back %llu ns", label, (unsigned long long)backwards);
}

int main(void)
{
	run("default");
	setenv("SLURMGUARD_HOOK_CLOCK", "monotonic", 1);
	run("forced monotonic");
	DONE("test_clock");
}
