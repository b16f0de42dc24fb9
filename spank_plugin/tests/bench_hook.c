/*
 * bench_hook.c - time ncclAllReduce calls into the fake libnccl.
 *
 *   bench_hook CALLS ROUNDS
 *   bench_hook_cuda CALLS ROUNDS BURST
 *
 * Prints one line per round: "ns_per_call <wall> cpu_ns_per_call <cpu>". Run once plain and once
 * with LD_PRELOAD=libslurmguard_nccl.so (and SLURMGUARD_RING_DIR set) to get
 * the hook's added cost; slurmguard bench hook does that, interleaved.
 *
 * bench_hook_cuda (built with -DWITH_CUDA, linked to the fake CUDA runtime)
 * issues the calls on a CUDA stream, whose fake kernels take no time, in
 * bursts of BURST calls like the collectives of a training step; between
 * bursts (not timed) it synchronises the stream and sleeps 2 ms, as a step's
 * compute would, so the hook's completion thread keeps up as on a GPU. Run
 * with SLURMGUARD_CUDA_EVENTS=0 for host timing only, unset for events.
 *
 * bench_hook_real (-DWITH_CUDA -DREAL_CUDA, `make gpu`) is bench_hook_cuda
 * linked to the real libnccl and CUDA runtime: a 1-rank communicator and
 * out-of-place calls on device buffers, so every call enqueues real work
 * (NCCL's one-rank path: a device-to-device copy) on a real stream.
 *
 * BENCH_REF_EVENTS=1 (CUDA builds, run without the hook): the reference,
 * two timing events recorded around each call by the program itself, the
 * least that CUDA-event timing can add.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../nccl_api.h"
#ifdef WITH_CUDA
#include "../cuda_api.h"
cudaError_t cudaStreamCreate(cudaStream_t *);
cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaMalloc(void **, size_t);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *, unsigned);
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t);
#endif

ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclAllReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
			   cudaStream_t);

#ifdef WITH_CUDA
static cudaEvent_t ref_ev[2]; /* BENCH_REF_EVENTS */
#endif

static ncclResult_t call(const float *in, float *out, ncclComm_t comm, cudaStream_t stream)
{
	ncclResult_t r;

#ifdef WITH_CUDA
	if (ref_ev[0])
		cudaEventRecord(ref_ev[0], stream);
#endif
	r = ncclAllReduce(in, out, 1, ncclFloat32, ncclSum, comm, stream);
#ifdef WITH_CUDA
	if (ref_ev[1])
		cudaEventRecord(ref_ev[1], stream);
#endif
	return r;
}

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
	long burst = argc > 3 ? atol(argv[3]) : 0;
	float in_host = 1.0f, out_host = 0.0f;
	float *in = &in_host, *out = &out_host;
	cudaStream_t stream = NULL;
	ncclUniqueId uid;
	ncclComm_t comm;
	int r;
	long i;

	if (burst <= 0 || burst > calls)
		burst = calls;
#ifdef REAL_CUDA
	/* a real communicator of one: nothing to wait for, real launches */
	const int nranks = 1;

	if (cudaMalloc((void **)&in, sizeof(float)) || cudaMalloc((void **)&out, sizeof(float))) {
		fprintf(stderr, "bench_hook: cudaMalloc failed\n");
		return 1;
	}
#else
	/* the fake NCCL's two-rank communicator, whose other rank is simulated */
	const int nranks = 2;
#endif
	ncclGetUniqueId(&uid);
	if (ncclCommInitRank(&comm, nranks, uid, 0) != ncclSuccess) {
		fprintf(stderr, "bench_hook: init failed\n");
		return 1;
	}
#ifdef WITH_CUDA
	cudaStreamCreate(&stream);
	{
		const char *ref = getenv("BENCH_REF_EVENTS");

		if (ref && *ref == '1' && (cudaEventCreateWithFlags(&ref_ev[0], cudaEventDefault) ||
					   cudaEventCreateWithFlags(&ref_ev[1], cudaEventDefault))) {
			fprintf(stderr, "bench_hook: cudaEventCreateWithFlags failed\n");
			return 1;
		}
	}
#endif
	/* warm up: ring creation, symbol lookup, page faults, event pool */
	for (i = 0; i < 1000; i++)
		if (call(in, out, comm, stream) != ncclSuccess) {
			fprintf(stderr, "bench_hook: ncclAllReduce failed\n");
			return 1;
		}
	for (r = 0; r < rounds; r++) {
		double wall = 0, cpu = 0;
		long done = 0;

		while (done < calls) {
			double t0 = clock_ns(CLOCK_MONOTONIC), c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);

			for (i = 0; i < burst && done < calls; i++, done++)
				call(in, out, comm, stream);
			/* wall time, and this thread's CPU time, which time slices
			 * given to other processes on a shared machine do not inflate */
			wall += clock_ns(CLOCK_MONOTONIC) - t0;
			cpu += clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
#ifdef WITH_CUDA
			{
				struct timespec nap = { 0, 2000000 };

				cudaStreamSynchronize(stream);
				nanosleep(&nap, NULL);
			}
#endif
		}
		printf("ns_per_call %.3f cpu_ns_per_call %.3f\n", wall / (double)calls,
		       cpu / (double)calls);
	}
#ifndef REAL_CUDA
	if (out_host != 2.0f) {
		fprintf(stderr, "bench_hook: wrong result %f\n", out_host);
		return 1;
	}
#endif
	return 0;
}
