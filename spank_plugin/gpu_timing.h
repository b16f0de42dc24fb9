/*
 * gpu_timing.h - GPU execution times of NCCL calls from CUDA events
 * (Greyhound 4.2), for the NCCL hook. See gpu_timing.c.
 *
 * Per timed call: sg_gpu_begin before the real call (records the start
 * event on the call's stream, or says why not), sg_gpu_end after it (the end
 * event), then the hook reserves and fills the record and hands it to
 * sg_gpu_submit instead of committing it; the completion thread commits it
 * with gpu_start_ns/gpu_end_ns once the end event has completed.
 */
#ifndef SG_GPU_TIMING_H
#define SG_GPU_TIMING_H

#include <stdint.h>

#include "cuda_api.h"
#include "sg_ring.h"

/* Before the call. Returns 0 with *pair >= 0 when the start event was
 * recorded; otherwise *pair = -1 and the flags for the record
 * (SG_F_CAPTURED, SG_F_NO_EVENT). Never fails the call. */
uint32_t sg_gpu_begin(struct sg_ring_header *h, cudaStream_t stream, int *pair);

/* After the call: record the end event. 0, or -1 (pair released; the
 * record gets SG_F_NO_EVENT and is committed by the caller). */
int sg_gpu_end(int pair, cudaStream_t stream);

/* Hand over record n (reserved in h, every field but seq written) for
 * commit once the pair's events completed. */
void sg_gpu_submit(struct sg_ring_header *h, struct sg_record *slot, uint64_t n, int pair,
		   cudaStream_t stream);

/* In a forked child: no events (the CUDA runtime does not survive fork),
 * never touch the parent's pending records. */
void sg_gpu_after_fork(void);

#endif /* SG_GPU_TIMING_H */
