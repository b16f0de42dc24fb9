/*
 * test_nolib.c - the hook in a process without NCCL, and with NCCL loaded
 * later with RTLD_LOCAL (invisible to RTLD_NEXT).
 *
 * Run with LD_PRELOAD=libslurmguard_nccl.so; argv[1] is the fake
 * libnccl.so.2. Not linked against NCCL: the entry points come from dlsym.
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

typedef ncclResult_t (*allreduce_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
				     ncclComm_t, cudaStream_t);
typedef ncclResult_t (*init_fn)(ncclComm_t *, int, ncclUniqueId, int);

int main(int argc, char **argv)
{
	char dir[] = "/tmp/sg-test-nolib-XXXXXX";
	char path[4096];
	allreduce_fn allreduce;
	init_fn init;
	ncclUniqueId uid;
	ncclComm_t comm = NULL;
	float in[4] = { 1, 2, 3, 4 }, out[4] = { 0 };
	struct sg_ring_header *h;
	struct sg_record r;
	const char *why;
	void *lib;

	if (argc != 2) {
		fprintf(stderr, "usage: test_nolib /path/to/fake/libnccl.so.2\n");
		return 2;
	}
	if (!mkdtemp(dir))
		return 2;
	setenv("SLURMGUARD_RING_DIR", dir, 1);
	setenv("RANK", "0", 1);
	unsetenv("SLURMGUARD_STEP_ID");

	allreduce = (allreduce_fn)dlsym(RTLD_DEFAULT, "ncclAllReduce");
	init = (init_fn)dlsym(RTLD_DEFAULT, "ncclCommInitRank");
	CHECK(allreduce && init, "the hook's entry points are not visible (preloaded?)");
	if (!allreduce || !init)
		DONE("test_nolib");
	/* no NCCL in the process: an error code, no crash, nothing recorded */
	CHECK(allreduce(in, out, 4, ncclFloat32, ncclSum, (ncclComm_t)0x1, NULL) == ncclSystemError,
	      "allreduce without NCCL");

	lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL, "dlopen %s: %s", argv[1], dlerror());
	if (!lib)
		DONE("test_nolib");
	memset(&uid, 7, sizeof(uid));
	CHECK(init(&comm, 2, uid, 0) == ncclSuccess && comm, "init through RTLD_LOCAL NCCL");
	CHECK(allreduce(in, out, 4, ncclFloat32, ncclSum, comm, NULL) == ncclSuccess,
	      "allreduce through RTLD_LOCAL NCCL");
	CHECK(out[3] == 8.0f, "result %f", out[3]);

	snprintf(path, sizeof(path), "%s/rank-0.step-%u.nccl.ring", dir, SG_STEP_PENDING);
	h = sg_ring_open(path, &why);
	CHECK(h != NULL, "ring %s: %s", path, why ? why : "");
	if (h) {
		CHECK(committed(h) == 2, "records %llu", (unsigned long long)committed(h));
		CHECK(sg_ring_read(h, 1, &r) == SG_READ_OK && r.op == SG_OP_ALLREDUCE && r.count == 4 &&
			      r.bytes == 16,
		      "allreduce record");
		sg_ring_unmap(h);
	}
	unlink(path);
	rmdir(dir);
	DONE("test_nolib");
}
