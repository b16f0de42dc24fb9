/*
 * bench_hook.c - time ncclAllReduce calls into the fake libnccl.
 *
 *   bench_hook CALLS ROUNDS
 *
 * Prints one line per round: "ns_per_call <wall> cpu_ns_per_call <cpu>". Run once plain and once
 * with LD_PRELOAD=libslurmguard_nccl.so (and SLURMGUARD_RING_DIR set) to get
 * the hook's added cost; slurmguard bench hook does that, interleaved.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../nccl_api.h"

ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclAllReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
			   cudaStream_t);

static double clock_ns(clockid_t id)
{
	struct timespec ts;

	clock_gettime(id, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	long calls = argc > 1 ? atol(argv[1]) : 1000000;
	int rounds = argc > 2 ? atoi(argv[2]) : 5;
	float in = 1.0f, out = 0.0f;
	ncclUniqueId uid;
	ncclComm_t comm;
	int r;
	long i;

	ncclGetUniqueId(&uid);
	if (ncclCommInitRank(&comm, 2, uid, 0) != ncclSuccess) {
		fprintf(stderr, "bench_hook: init failed\n");
		return 1;
	}
	/* warm up: ring creation, symbol lookup, page faults */
	for (i = 0; i < 1000; i++)
		ncclAllReduce(&in, &out, 1, ncclFloat32, ncclSum, comm, NULL);
	for (r = 0; r < rounds; r++) {
		double t0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);

		for (i = 0; i < calls; i++)
			ncclAllReduce(&in, &out, 1, ncclFloat32, ncclSum, comm, NULL);
		/* wall time, and this thread's CPU time, which time slices given
		 * to other processes on a shared machine do not inflate */
		printf("ns_per_call %.3f cpu_ns_per_call %.3f\n",
		       (clock_ns(CLOCK_MONOTONIC) - t0) / (double)calls,
		       (clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0) / (double)calls);
	}
	if (out != 2.0f) {
		fprintf(stderr, "bench_hook: wrong result %f\n", out);
		return 1;
	}
	return 0;
}
