/*
 * test_old.c - the hook against an "old NCCL" (fake built with
 * FAKE_NCCL_OLD): entry points the library lacks fail with ncclSystemError
 * and leave no record; everything else works and is recorded.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../nccl_api.h"
#include "../sg_ring.h"
#include "../sg_ring_file.h"
#include "check.h"

ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclAllReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
			   cudaStream_t);

typedef ncclResult_t (*alltoall_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
				    cudaStream_t);
typedef ncclResult_t (*split_fn)(ncclComm_t, int, int, ncclComm_t *, void *);

int main(void)
{
	char dir[] = "/tmp/sg-test-old-XXXXXX";
	char path[4096];
	ncclUniqueId uid;
	ncclComm_t comm = NULL, sub = NULL;
	int32_t in[6] = { 1, 2, 3, 4, 5, 6 }, out[12];
	struct sg_ring_header *h;
	struct sg_record r;
	const char *why;
	alltoall_fn a2a;
	split_fn split;
	int version = 0;

	if (!mkdtemp(dir))
		return 2;
	setenv("SLURMGUARD_RING_DIR", dir, 1);
	setenv("SLURMGUARD_STEP_ID", "4294967291", 1); /* the batch step */
	setenv("SLURM_PROCID", "1", 1);
	unsetenv("RANK");

	CHECK(ncclGetVersion(&version) == ncclSuccess && version < 22800, "version %d", version);
	ncclGetUniqueId(&uid);
	CHECK(ncclCommInitRank(&comm, 2, uid, 1) == ncclSuccess, "init");
	a2a = (alltoall_fn)dlsym(RTLD_DEFAULT, "ncclAllToAll");
	split = (split_fn)dlsym(RTLD_DEFAULT, "ncclCommSplit");
	CHECK(a2a && split, "hook entry points not visible (preloaded?)");
	if (a2a)
		CHECK(a2a(in, out, 3, ncclInt32, comm, NULL) == ncclSystemError,
		      "alltoall on old NCCL");
	if (split)
		CHECK(split(comm, 0, 0, &sub, NULL) == ncclSystemError && sub == NULL,
		      "split on old NCCL");
	CHECK(ncclAllReduce(in, out, 6, ncclInt32, ncclSum, comm, NULL) == ncclSuccess &&
		      out[5] == 12,
	      "allreduce on old NCCL");

	snprintf(path, sizeof(path), "%s/rank-1.step-batch.nccl.ring", dir);
	h = sg_ring_open(path, &why);
	CHECK(h != NULL, "ring %s: %s", path, why ? why : "");
	if (h) {
		CHECK(committed(h) == 2, "records %llu, want init + allreduce",
		      (unsigned long long)committed(h));
		CHECK(sg_ring_read(h, 0, &r) == SG_READ_OK && r.op == SG_OP_COMM_INIT && r.peer == 1 &&
			      r.count == 2,
		      "init record");
		CHECK(sg_ring_read(h, 1, &r) == SG_READ_OK && r.op == SG_OP_ALLREDUCE &&
			      r.datatype == SG_DT_INT32 && r.bytes == 24,
		      "allreduce record");
		CHECK(h->global_rank == 1 && h->step_id == SG_STEP_BATCH, "rank %d step %u",
		      h->global_rank, h->step_id);
		sg_ring_unmap(h);
	}
	unlink(path);
	rmdir(dir);
	DONE("test_old");
}
