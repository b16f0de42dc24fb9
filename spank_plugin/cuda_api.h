/*
 * cuda_api.h - the subset of the CUDA runtime API that the NCCL hook calls
 * and the fake runtime (tests/fake_cudart.c) implements, declared from
 * NVIDIA's CUDA Runtime API reference ("Event Management", "Stream
 * Management", "Error Handling", cudaError_t values).
 *
 * Only the ABI matters: enum values, argument order, handle types. The hook
 * never links the runtime: it resolves these functions in the one the job
 * already loaded (nccl_hook.c, cuda_resolve).
 */
#ifndef SG_CUDA_API_H
#define SG_CUDA_API_H

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraph_st *cudaGraph_t;

/* cudaError_t values used here (driver_types.h) */
typedef enum {
	cudaSuccess = 0,
	cudaErrorInvalidValue = 1,
	cudaErrorMemoryAllocation = 2,
	cudaErrorInitializationError = 3,
	cudaErrorCudartUnloading = 4,
	cudaErrorNoDevice = 100,
	cudaErrorInvalidDevice = 101,
	cudaErrorInvalidResourceHandle = 400,
	cudaErrorNotReady = 600,
	cudaErrorIllegalAddress = 700,
	cudaErrorLaunchFailure = 719,
	cudaErrorStreamCaptureUnsupported = 900,
	cudaErrorStreamCaptureInvalidated = 901,
	cudaErrorStreamCaptureImplicit = 906,
	cudaErrorCapturedEvent = 907,
	cudaErrorUnknown = 999
} cudaError_t;

/* cudaEventCreateWithFlags flags */
#define cudaEventDefault       0x00u
#define cudaEventBlockingSync  0x01u
#define cudaEventDisableTiming 0x02u

/* cudaStreamCreateWithFlags flags */
#define cudaStreamDefault     0x00u
#define cudaStreamNonBlocking 0x01u

/* special stream handles */
#define cudaStreamLegacy    ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

typedef enum {
	cudaStreamCaptureStatusNone = 0,
	cudaStreamCaptureStatusActive = 1,
	cudaStreamCaptureStatusInvalidated = 2
} cudaStreamCaptureStatus;

typedef enum {
	cudaStreamCaptureModeGlobal = 0,
	cudaStreamCaptureModeThreadLocal = 1,
	cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;

#endif /* SG_CUDA_API_H */
