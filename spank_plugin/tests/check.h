/* check.h - tiny assertion helpers for the C tests: every failed CHECK is
 * printed with its line, and DONE() prints the closing line and makes the
 * exit status non-zero if anything failed. */
#ifndef SG_CHECK_H
#define SG_CHECK_H

#include <stdio.h>

static int check_failures;
static int check_count;

#define CHECK(cond, ...)                                                       \
	do {                                                                   \
		check_count++;                                                 \
		if (!(cond)) {                                                 \
			check_failures++;                                      \
			fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, \
				__LINE__, #cond);                              \
			fprintf(stderr, __VA_ARGS__);                          \
			fputc('\n', stderr);                                   \
		}                                                              \
	} while (0)

#define DONE(name)                                                             \
	do {                                                                   \
		printf("%s: %d checks, %d failed: %s\n", name, check_count,   \
		       check_failures, check_failures ? "FAIL" : "OK");         \
		return check_failures ? 1 : 0;                                 \
	} while (0)

#ifdef SG_RING_H
/* Records committed so far by a single-threaded writer: the first number
 * not yet committed (write_counter may run a block ahead, see sg_ring.h). */
static inline uint64_t committed(struct sg_ring_header *h)
{
	uint64_t wc = atomic_load(&h->write_counter);
	uint64_t n = wc > h->capacity ? wc - h->capacity : 0;
	struct sg_record r;

	while (n < wc && sg_ring_read(h, n, &r) != SG_READ_NOT_YET)
		n++;
	return n;
}
#endif

#endif
