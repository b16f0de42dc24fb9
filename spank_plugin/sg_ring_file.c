/*
 * sg_ring_file.c - create and map ring files (format in sg_ring.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
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

static int env_int(const char *name, int fallback)
{
	const char *v = getenv(name);
	char *end;
	long x;

	if (!v || !*v)
		return fallback;
	errno = 0;
	x = strtol(v, &end, 10);
	if (errno || *end || x < INT_MIN || x > INT_MAX)
		return fallback;
	return (int)x;
}

static uint32_t env_u32(const char *name, uint32_t fallback)
{
	const char *v = getenv(name);
	char *end;
	unsigned long long x;

	if (!v || !*v || *v == '-')
		return fallback;
	errno = 0;
	x = strtoull(v, &end, 10);
	if (errno || *end || x > UINT32_MAX)
		return fallback;
	return (uint32_t)x;
}

static int env_first_int(const char *const *names, int fallback)
{
	for (; *names; names++) {
		int v = env_int(*names, INT_MIN);

		if (v != INT_MIN)
			return v;
	}
	return fallback;
}

/* The ring of this process, named and described from the environment the
 * SPANK plugin sets (see sg_ring_file.h). */
struct sg_ring_header *sg_ring_create_for_rank(const char *source_name, uint32_t source,
					       int rank_hint, int size_hint)
{
	static const char *const rank_vars[] = { "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
						 "PMI_RANK", NULL };
	static const char *const size_vars[] = { "WORLD_SIZE", "SLURM_NTASKS",
						 "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", NULL };
	static const char *const local_vars[] = { "LOCAL_RANK", "SLURM_LOCALID",
						  "OMPI_COMM_WORLD_LOCAL_RANK", NULL };
	const char *dir = getenv("SLURMGUARD_RING_DIR");
	struct sg_ring_meta m;
	struct sg_ring_header *h;
	char host[SG_NODE_NAME_LEN];
	char path[PATH_MAX], sbuf[16];
	const char *node, *sname;
	int n;

	if (!dir || dir[0] != '/') {
		errno = ENOENT;
		return NULL;
	}
	memset(&m, 0, sizeof(m));
	m.capacity = env_u32("SLURMGUARD_RING_RECORDS", SG_RING_DEFAULT_CAPACITY);
	m.job_id = env_u32("SLURMGUARD_JOB_ID", 0);
	m.step_id = env_u32("SLURMGUARD_STEP_ID", SG_STEP_PENDING);
	m.global_rank = env_first_int(rank_vars, rank_hint);
	m.world_size = env_first_int(size_vars, size_hint);
	m.local_rank = env_first_int(local_vars, -1);
	m.source = source;
	node = getenv("SLURMD_NODENAME");
	if (!node || !*node) {
		if (gethostname(host, sizeof(host)) != 0)
			host[0] = '\0';
		host[sizeof(host) - 1] = '\0';
		node = host;
	}
	m.node_name = node;
	sname = sg_step_name(m.step_id, sbuf, sizeof(sbuf));
	n = snprintf(path, sizeof(path), "%s/rank-%d.step-%s.%s.ring", dir, m.global_rank, sname,
		     source_name);
	if (n < 0 || (size_t)n >= sizeof(path))
		return NULL;
	h = sg_ring_create(path, &m);
	if (!h && errno == EEXIST) {
		/* same rank twice (a relaunch in the same step, or a forked
		 * child): keep both, the header says whose is whose */
		n = snprintf(path, sizeof(path), "%s/rank-%d.step-%s.%s.pid-%d.ring", dir,
			     m.global_rank, sname, source_name, (int)getpid());
		if (n < 0 || (size_t)n >= sizeof(path))
			return NULL;
		h = sg_ring_create(path, &m);
	}
	if (!h)
		fprintf(stderr, "slurmguard: NCCL call timing off: cannot create %s: %s\n", path,
			strerror(errno));
	return h;
}

uint32_t sg_ring_hold(struct sg_ring_header *h, uint64_t *t0, uint64_t *t1)
{
	uint32_t tmo = h->hold_timeout_ms ? h->hold_timeout_ms : SG_HOLD_DEFAULT_TIMEOUT_MS;
	uint64_t limit = (uint64_t)tmo * 1000000ull;
	struct timespec nap = { 0, 1000000 };
	uint32_t flags = 0;

	*t0 = sg_mono_ns();
	atomic_store(&h->hold_since_ns, *t0);
	while (atomic_load_explicit(&h->control, memory_order_acquire) & SG_CTL_HOLD) {
		if (sg_mono_ns() - *t0 >= limit) {
			/* the controller is gone or too slow: release everyone */
			atomic_fetch_and(&h->control, ~SG_CTL_HOLD);
			atomic_fetch_add(&h->hold_timeouts, 1);
			flags = SG_F_TIMEOUT;
			break;
		}
		nanosleep(&nap, NULL);
	}
	atomic_store(&h->hold_since_ns, 0);
	atomic_fetch_add(&h->holds, 1);
	*t1 = sg_mono_ns();
	return flags;
}
