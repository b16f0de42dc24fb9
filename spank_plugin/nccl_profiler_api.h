/*
 * nccl_profiler_api.h - the parts of NCCL's profiler plugin interface
 * (ext-profiler / plugins/profiler, "ncclProfiler_vN") that
 * libslurmguard_nccl_profiler.so implements and the fake NCCL core drives,
 * declared from NCCL's plugin documentation and its versioned headers.
 *
 * Versions: v4 (NCCL 2.27), v5 (NCCL 2.28), v6 (NCCL 2.29 and later). v1-v3
 * (NCCL 2.23-2.26) have no GPU timestamps in their kernel events, so the
 * plugin does not offer them and those NCCL versions keep the LD_PRELOAD
 * hook (NCCL finds no symbol it knows and runs without the plugin).
 *
 * Only the ABI matters: the event descriptor's fixed head (type, parentObj,
 * rank) and, in its union, the members read here, laid out as NCCL lays
 * them out; the union is read by member, never copied whole (v6's is
 * larger). Event type bits and state values are NCCL's.
 */
#ifndef SG_NCCL_PROFILER_API_H
#define SG_NCCL_PROFILER_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "nccl_api.h"

/* event types (eDescr->type, and bits of eActivationMask) */
enum {
	ncclProfileGroup = 1 << 0,
	ncclProfileColl = 1 << 1,
	ncclProfileP2p = 1 << 2,
	ncclProfileProxyOp = 1 << 3,
	ncclProfileProxyStep = 1 << 4,
	ncclProfileProxyCtrl = 1 << 5,
	ncclProfileKernelCh = 1 << 6,
	ncclProfileNetPlugin = 1 << 7,
	ncclProfileGroupApi = 1 << 8,   /* v5 */
	ncclProfileCollApi = 1 << 9,    /* v5 */
	ncclProfileP2pApi = 1 << 10,    /* v5 */
	ncclProfileKernelLaunch = 1 << 11, /* v5 */
};

/* recordEventState states used here */
typedef enum {
	ncclProfilerProxyStepSendGPUWait = 8,   /* send: waiting for the GPU's data */
	ncclProfilerProxyStepSendWait = 9,      /* send: on the network */
	ncclProfilerProxyStepRecvWait = 10,     /* recv: waiting for data from the network */
	ncclProfilerProxyStepRecvFlushWait = 11, /* recv: flushing to the GPU */
	ncclProfilerProxyStepRecvGPUWait = 12,  /* recv: waiting for the GPU to consume */
	ncclProfilerProxyOpInProgress_v4 = 19,
	ncclProfilerProxyStepSendPeerWait_v4 = 20, /* send: waiting for the peer's credits */
	ncclProfilerKernelChStop = 22,          /* kernel channel done; pTimer in args */
} ncclProfilerEventState_t;

typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char *file, int line,
				  const char *fmt, ...);

/* the descriptor union, members as NCCL v4/v5/v6 lay them out */
union sg_nccl_prof_descr_u {
	struct {
		uint64_t seqNumber;
		const char *func;
		void const *sendBuff;
		void *recvBuff;
		size_t count;
		int root;
		const char *datatype;
		uint8_t nChannels;
		uint8_t nWarps;
		const char *algo;
		const char *proto;
		void *parentGroup; /* v5 and later */
	} coll;
	struct {
		const char *func;
		void *buff;
		const char *datatype;
		size_t count;
		int peer;
		uint8_t nChannels;
		void *parentGroup; /* v5 and later */
	} p2p;
	struct {
		pid_t pid;
		uint8_t channelId;
		int peer;
		int nSteps;
		int chunkSize;
		int isSend;
	} proxyOp;
	struct {
		int step;
	} proxyStep;
	struct {
		uint8_t channelId;
		uint64_t pTimer; /* GPU globaltimer (ns) at the channel's start */
	} kernelCh;
};

typedef struct {
	uint8_t type;
	void *parentObj;
	int rank;
	union sg_nccl_prof_descr_u u;
} ncclProfilerEventDescr_v4_t;

typedef struct {
	uint64_t type;
	void *parentObj;
	int rank;
	union sg_nccl_prof_descr_u u;
} ncclProfilerEventDescr_v5_t; /* v6: the same head, a larger union */

typedef union {
	struct {
		size_t transSize;
	} proxyStep;
	struct {
		int appendedProxyOps;
	} proxyCtrl;
	struct {
		void *data;
	} netPlugin;
	struct {
		uint64_t pTimer; /* GPU globaltimer (ns) at the channel's stop */
	} kernelCh;
} ncclProfilerEventStateArgs_v4_t; /* v5, v6: the same */

typedef struct {
	const char *name;
	ncclResult_t (*init)(void **context, int *eActivationMask, const char *commName,
			     uint64_t commHash, int nNodes, int nranks, int rank,
			     ncclDebugLogger_t logfn);
	ncclResult_t (*startEvent)(void *context, void **eHandle,
				   ncclProfilerEventDescr_v4_t *eDescr);
	ncclResult_t (*stopEvent)(void *eHandle);
	ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState,
					 ncclProfilerEventStateArgs_v4_t *eStateArgs);
	ncclResult_t (*finalize)(void *context);
} ncclProfiler_v4_t;

typedef struct {
	const char *name;
	ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask,
			     const char *commName, int nNodes, int nranks, int rank,
			     ncclDebugLogger_t logfn);
	ncclResult_t (*startEvent)(void *context, void **eHandle,
				   ncclProfilerEventDescr_v5_t *eDescr);
	ncclResult_t (*stopEvent)(void *eHandle);
	ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState,
					 ncclProfilerEventStateArgs_v4_t *eStateArgs);
	ncclResult_t (*finalize)(void *context);
} ncclProfiler_v5_t; /* v6: the same functions */

_Static_assert(offsetof(ncclProfilerEventDescr_v4_t, u) == 24, "descriptor union offset");
_Static_assert(offsetof(ncclProfilerEventDescr_v5_t, u) == 24, "descriptor union offset");

#endif /* SG_NCCL_PROFILER_API_H */
