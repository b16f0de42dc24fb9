/*
 * ref_shim.c - the yardstick for the hook's cost: the least an LD_PRELOAD
 * monitor can do per ncclAllReduce (two CLOCK_MONOTONIC timestamps and one
 * 32-byte record appended with an atomic index into a 2 MiB ring). Only
 * `slurmguard bench hook` uses it, to print next to the hook's figure.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "../nccl_api.h"

struct ref_record {
	uint64_t start_ns, end_ns, count;
	uint32_t op;
	int32_t status;
};

#define REF_SLOTS 65536u
static struct ref_record ref_ring[REF_SLOTS];
static _Atomic uint64_t ref_next;

typedef ncclResult_t (*allreduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
				     ncclComm_t, cudaStream_t);

static inline uint64_t now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, ncclDataType_t dt,
			   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
	static allreduce_fn real;
	struct ref_record *rec;
	uint64_t t0, t1;
	ncclResult_t rc;

	if (!real)
		real = (allreduce_fn)dlsym(RTLD_NEXT, "ncclAllReduce");
	t0 = now();
	rc = real(s, r, count, dt, op, comm, stream);
	t1 = now();
	rec = &ref_ring[atomic_fetch_add_explicit(&ref_next, 1, memory_order_relaxed) & (REF_SLOTS - 1)];
	rec->start_ns = t0;
	rec->end_ns = t1;
	rec->count = count;
	rec->op = 1;
	rec->status = rc;
	return rc;
}
