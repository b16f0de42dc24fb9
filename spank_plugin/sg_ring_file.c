/*
 * sg_ring_file.c - create and map ring files (format in sg_ring.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sg_ring_file.h"

uint64_t sg_mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int64_t clock_offset_ns(void)
{
	struct timespec m1, r, m2;
	int64_t mono, real;

	/* bracket the realtime read so the offset error is at most half the gap */
	clock_gettime(CLOCK_MONOTONIC, &m1);
	clock_gettime(CLOCK_REALTIME, &r);
	clock_gettime(CLOCK_MONOTONIC, &m2);
	mono = ((int64_t)m1.tv_sec * 1000000000ll + m1.tv_nsec) / 2 +
	       ((int64_t)m2.tv_sec * 1000000000ll + m2.tv_nsec) / 2;
	real = (int64_t)r.tv_sec * 1000000000ll + r.tv_nsec;
	return real - mono;
}

uint32_t sg_ring_round_capacity(uint64_t want)
{
	uint32_t c = SG_RING_MIN_CAPACITY;

	while (c < want && c < SG_RING_MAX_CAPACITY)
		c <<= 1;
	return c;
}

struct sg_ring_header *sg_ring_create(const char *path, const struct sg_ring_meta *m)
{
	uint32_t cap = sg_ring_round_capacity(m->capacity ? m->capacity : SG_RING_DEFAULT_CAPACITY);
	size_t size = sg_ring_file_size(cap);
	struct sg_ring_header *h;
	int fd, err;

	fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0)
		return NULL;
	err = posix_fallocate(fd, 0, (off_t)size);
	if (err != 0) {
		unlink(path);
		close(fd);
		errno = err;
		return NULL;
	}
	h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	err = errno;
	close(fd);
	if (h == MAP_FAILED) {
		unlink(path);
		errno = err;
		return NULL;
	}
	/* the file is zero-filled: only non-zero fields need writing */
	h->version = SG_RING_VERSION;
	h->header_size = SG_RING_HEADER_SIZE;
	h->record_size = SG_RING_RECORD_SIZE;
	h->capacity = cap;
	h->job_id = m->job_id;
	h->step_id = m->step_id;
	h->global_rank = m->global_rank;
	h->local_rank = m->local_rank;
	h->world_size = m->world_size;
	h->pid = (uint32_t)getpid();
	h->clock_offset_ns = clock_offset_ns();
	h->created_ns = sg_mono_ns();
	h->source = m->source;
	if (m->node_name)
		snprintf(h->node_name, sizeof(h->node_name), "%s", m->node_name);
	__atomic_store_n(&h->magic, SG_RING_MAGIC, __ATOMIC_RELEASE);
	return h;
}

struct sg_ring_header *sg_ring_open(const char *path, const char **why)
{
	struct sg_ring_header *h;
	struct stat st;
	size_t size;
	int fd;

	*why = NULL;
	fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0) {
		*why = "cannot open";
		return NULL;
	}
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
	    (size_t)st.st_size < SG_RING_HEADER_SIZE) {
		close(fd);
		*why = "truncated header";
		errno = EINVAL;
		return NULL;
	}
	size = (size_t)st.st_size;
	h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (h == MAP_FAILED) {
		*why = "cannot map";
		return NULL;
	}
	if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SG_RING_MAGIC)
		*why = "bad magic";
	else if (h->version < SG_RING_VERSION)
		*why = "older ring format version (written by an earlier slurmguard; "
		       "this reader knows version " SG_STR(SG_RING_VERSION_NUM) ")";
	else if (h->version != SG_RING_VERSION)
		*why = "newer ring format version than this reader knows";
	else if (h->header_size != SG_RING_HEADER_SIZE || h->record_size != SG_RING_RECORD_SIZE)
		*why = "bad geometry";
	else if (h->capacity < SG_RING_MIN_CAPACITY || h->capacity > SG_RING_MAX_CAPACITY ||
		 (h->capacity & (h->capacity - 1)) != 0)
		*why = "bad capacity";
	else if (size < sg_ring_file_size(h->capacity))
		*why = "truncated records";
	if (*why) {
		munmap(h, size);
		errno = EINVAL;
		return NULL;
	}
	return h;
}

void sg_ring_unmap(struct sg_ring_header *h)
{
	if (h)
		munmap(h, sg_ring_file_size(h->capacity));
}
