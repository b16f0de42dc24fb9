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

#endif /* SG_RING_FILE_H */
