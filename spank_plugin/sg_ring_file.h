/*
 * sg_ring_file.h - create and map ring files (format in sg_ring.h).
 * Shared by the NCCL hook and the C tools/tests; no Slurm or NCCL needed.
 */
#ifndef SG_RING_FILE_H
#define SG_RING_FILE_H

#include <stdint.h>

#include "sg_ring.h"

struct sg_ring_meta {
	uint32_t capacity;  /* records; rounded up to a power of two */
	uint32_t job_id;
	uint32_t step_id;
	int32_t global_rank;
	int32_t local_rank;
	int32_t world_size;
	uint32_t source;    /* SG_SOURCE_* */
	const char *node_name;
};

/*
 * Create path exclusively (mode 0600, no symlink follow), reserve its memory
 * up front (so a full /dev/shm is an error here, never a SIGBUS later),
 * map it and write the header. Returns the mapping or NULL with errno set.
 */
struct sg_ring_header *sg_ring_create(const char *path, const struct sg_ring_meta *m);

/*
 * Map an existing ring read-write (for readers and the control word).
 * Returns NULL with errno set, and a reason in *why, if the file is too
 * short, has a bad magic/version/geometry, or cannot be mapped.
 */
struct sg_ring_header *sg_ring_open(const char *path, const char **why);

void sg_ring_unmap(struct sg_ring_header *h);

/* Round up to a power of two within [SG_RING_MIN_CAPACITY, SG_RING_MAX_CAPACITY]. */
uint32_t sg_ring_round_capacity(uint64_t want);

uint64_t sg_mono_ns(void);

/*
 * Create this process's ring for a writer (source_name: "nccl", "ncclprof";
 * source: SG_SOURCE_*) in $SLURMGUARD_RING_DIR, named
 * rank-<rank>.step-<step>.<source_name>[.pid-<pid>].ring, the header filled
 * from SLURMGUARD_* and the launcher's rank variables (RANK, SLURM_PROCID,
 * ...; the hints when none is set). NULL with errno ENOENT when
 * SLURMGUARD_RING_DIR is unset (not guarded); NULL after one stderr line
 * when the file cannot be made.
 */
struct sg_ring_header *sg_ring_create_for_rank(const char *source_name, uint32_t source,
					       int rank_hint, int size_hint);

/*
 * Serve a hold the controller asked for (SG_CTL_HOLD, Greyhound 4.3): wait
 * (1 ms polls) until the bit is cleared or hold_timeout_ms passes, keep the
 * counters. t0, t1: CLOCK_MONOTONIC ns of the wait; returns the hold
 * record's flags (SG_F_TIMEOUT when released by the timeout).
 */
uint32_t sg_ring_hold(struct sg_ring_header *h, uint64_t *t0, uint64_t *t1);

#endif /* SG_RING_FILE_H */
