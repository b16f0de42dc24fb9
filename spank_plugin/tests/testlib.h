/* testlib.h - what the C tests of the hook and the profiler plugin share:
 * the NCCL, CUDA runtime and fake-control functions they call (declared
 * once, as the application code they stand for would see them), a scratch
 * ring directory, and reading a rank's ring. Header-only: static inline. */
#ifndef SG_TESTLIB_H
#define SG_TESTLIB_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../cuda_api.h"
#include "../nccl_api.h"
#include "../sg_ring.h"
#include "../sg_ring_file.h"
#include "check.h"

#define MS 1000000ull
#define US 1000ull

/* NCCL (the hook intercepts these; the fake NCCL implements them) */
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
				    ncclConfig_t *config);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
			   ncclConfig_t *config);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
			   cudaStream_t);
ncclResult_t ncclAllGather(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
			   cudaStream_t);
ncclResult_t ncclReduceScatter(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
			       ncclComm_t, cudaStream_t);
ncclResult_t ncclBroadcast(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
			   cudaStream_t);
ncclResult_t ncclBcast(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int,
			ncclComm_t, cudaStream_t);
ncclResult_t ncclAllToAll(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
			  cudaStream_t);
ncclResult_t ncclSend(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclRecv(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

/* the fake NCCL's controls (tests/fake_nccl.c) */
unsigned long long fakeNcclCalls(const char *name, unsigned long long *elems);
void fakeNcclSetTiming(uint64_t enqueue_ns, uint64_t kernel_ns);
void fakeNcclSetLink(int peer, uint64_t ns);

/* the CUDA runtime (the fake one in these tests, tests/fake_cudart.c) */
cudaError_t cudaSetDevice(int);
cudaError_t cudaStreamCreate(cudaStream_t *);
cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode);
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *);
cudaError_t cudaGraphDestroy(cudaGraph_t);

/* the fake CUDA runtime's controls */
unsigned long long fakeCudaCalls(const char *name);
void fakeCudaFail(const char *name, cudaError_t err, long after);
unsigned fakeCudaGraphNodes(cudaGraph_t);
unsigned fakeCudaInvalidated(void);
cudaError_t fakeCudaLaunch(cudaStream_t, uint64_t ns, void (*fn)(void *), void *arg);

static inline void sleep_ns(uint64_t ns)
{
	struct timespec ts = { (time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull) };

	nanosleep(&ts, NULL);
}

/* A fresh ring directory from a mkdtemp template ("/tmp/x-XXXXXX"), set as
 * SLURMGUARD_RING_DIR; exits the test (status 2) if it cannot be made. */
static inline void test_dir_make(char *tmpl)
{
	if (!mkdtemp(tmpl)) {
		perror("mkdtemp");
		exit(2);
	}
	setenv("SLURMGUARD_RING_DIR", tmpl, 1);
}

/* Remove the files in dir (not the directory). */
static inline void test_dir_clean(const char *dir)
{
	char path[1024];
	DIR *d = opendir(dir);
	struct dirent *de;

	while (d && (de = readdir(d))) {
		if (de->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		unlink(path);
	}
	if (d)
		closedir(d);
}

static inline void test_dir_remove(const char *dir)
{
	test_dir_clean(dir);
	rmdir(dir);
}

/* The ring rank-<rank>.step-<step>.<source>.ring in dir, mapped; NULL (and
 * a failed CHECK when must) if it is missing or unusable. */
static inline struct sg_ring_header *test_ring(const char *dir, int rank, const char *step,
					       const char *source, int must)
{
	char path[1024];
	const char *why = NULL;
	struct sg_ring_header *h;

	snprintf(path, sizeof(path), "%s/rank-%d.step-%s.%s.ring", dir, rank, step, source);
	if (!must && access(path, F_OK) != 0)
		return NULL;
	h = sg_ring_open(path, &why);
	CHECK(h != NULL || !must, "ring %s: %s (is the hook preloaded?)", path, why ? why : "");
	return h;
}

/* Records of op committed in h so far. */
static inline int test_count_op(struct sg_ring_header *h, uint16_t op)
{
	uint64_t n, wc = h ? atomic_load(&h->write_counter) : 0;
	struct sg_record r;
	int k = 0;

	for (n = 0; n < wc; n++)
		if (sg_ring_read(h, n, &r) == SG_READ_OK && r.op == op)
			k++;
	return k;
}

#endif
