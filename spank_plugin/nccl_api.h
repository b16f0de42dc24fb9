/*
 * nccl_api.h - the subset of NCCL's public C API that the hook intercepts
 * and the fake library implements, declared from NVIDIA's API reference
 * (docs.nvidia.com/deeplearning/nccl, "Collective Communication Functions",
 * "Communicator Creation and Management", "Group Calls", "Point To Point").
 *
 * Only the ABI matters here: enum values, argument order and types. Handles
 * are opaque pointers; cudaStream_t is an opaque pointer as in CUDA. Compiled
 * against this file, the hook needs neither CUDA nor NCCL headers.
 */
#ifndef SG_NCCL_API_H
#define SG_NCCL_API_H

#include <stddef.h>

typedef struct ncclComm *ncclComm_t;
typedef struct CUstream_st *cudaStream_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
	char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

/* ncclConfig_t's layout changes between NCCL versions; the hook only passes
 * the pointer through. */
typedef struct ncclConfig_v_opaque ncclConfig_t;

typedef enum {
	ncclSuccess = 0,
	ncclUnhandledCudaError = 1,
	ncclSystemError = 2,
	ncclInternalError = 3,
	ncclInvalidArgument = 4,
	ncclInvalidUsage = 5,
	ncclRemoteError = 6,
	ncclInProgress = 7,
	ncclNumResults = 8
} ncclResult_t;

/* Values are NCCL's; aliases (ncclChar, ncclInt, ncclHalf, ncclFloat,
 * ncclDouble) share them. */
typedef enum {
	ncclInt8 = 0,
	ncclUint8 = 1,
	ncclInt32 = 2,
	ncclUint32 = 3,
	ncclInt64 = 4,
	ncclUint64 = 5,
	ncclFloat16 = 6,
	ncclFloat32 = 7,
	ncclFloat64 = 8,
	ncclBfloat16 = 9,     /* NCCL >= 2.10 */
	ncclFloat8e4m3 = 10,  /* NCCL >= 2.19 */
	ncclFloat8e5m2 = 11,  /* NCCL >= 2.19 */
	ncclNumTypes = 12
} ncclDataType_t;

/* ncclRedOp_t is an enum in the ABI (an int); ops created with
 * ncclRedOpCreatePreMulSum have values >= ncclNumOps. */
typedef enum {
	ncclSum = 0,
	ncclProd = 1,
	ncclMax = 2,
	ncclMin = 3,
	ncclAvg = 4,
	ncclNumOps = 5,
	ncclMaxRedOp = 0x7fffffff
} ncclRedOp_t;

#define NCCL_SPLIT_NOCOLOR -1

#endif /* SG_NCCL_API_H */
