/*
 * ringdir.c - create <ring_root>/<jobid> for the job's user.
 *
 * slurmstepd runs this as root, in a directory tree other users can write
 * to (/dev/shm is world-writable), so nothing is trusted by name: the root
 * must be a real directory owned by root and writable by root only, the job
 * directory is opened without following symlinks and fixed up through its
 * descriptor (fchown/fchmod), and a job directory that belongs to someone
 * else is refused rather than taken over.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sg_plugin.h"

/* mkdir -p for the admin's ring root (components created 0755). */
static int make_root(const char *root, char *err, size_t errlen)
{
	char path[PATH_MAX];
	size_t i, len = strlen(root);

	if (len >= sizeof(path)) {
		snprintf(err, errlen, "ring root %s: path too long", root);
		return -1;
	}
	memcpy(path, root, len + 1);
	for (i = 1; i <= len; i++) {
		if (path[i] != '/' && path[i] != '\0')
			continue;
		path[i] = '\0';
		if (mkdir(path, 0755) != 0 && errno != EEXIST) {
			snprintf(err, errlen, "cannot create %s: %s", path, strerror(errno));
			return -1;
		}
		path[i] = root[i];
	}
	return 0;
}

int sg_make_job_dir(const char *root, uint32_t job_id, uid_t uid, gid_t gid, char *out,
		    size_t outlen, char *err, size_t errlen)
{
	char name[16];
	struct stat st;
	int rootfd, fd, n;

	err[0] = '\0';
	if (make_root(root, err, errlen) != 0)
		return -1;
	rootfd = open(root, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (rootfd < 0) {
		snprintf(err, errlen, "cannot open ring root %s: %s", root, strerror(errno));
		return -1;
	}
	if (fstat(rootfd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 022)) {
		snprintf(err, errlen,
			 "ring root %s must be a directory owned by uid %u and writable only by it "
			 "(found uid %u mode %04o); refusing (create it at boot as root: "
			 "systemd/slurmguard-tmpfiles.conf)",
			 root, (unsigned)geteuid(), (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
		close(rootfd);
		return -1;
	}
	snprintf(name, sizeof(name), "%u", job_id);
	if (mkdirat(rootfd, name, 0700) != 0 && errno != EEXIST) {
		snprintf(err, errlen, "cannot create %s/%s: %s", root, name, strerror(errno));
		close(rootfd);
		return -1;
	}
	fd = openat(rootfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	close(rootfd);
	if (fd < 0 || fstat(fd, &st) != 0) {
		snprintf(err, errlen, "cannot open %s/%s: %s", root, name, strerror(errno));
		if (fd >= 0)
			close(fd);
		return -1;
	}
	/* just created by us or by the step on another node of this host
	 * (owned by root until chowned), or already the user's */
	if (st.st_uid != uid && st.st_uid != geteuid()) {
		snprintf(err, errlen, "%s/%s exists and belongs to uid %u, not the job's uid %u; "
			 "refusing", root, name, (unsigned)st.st_uid, (unsigned)uid);
		close(fd);
		return -1;
	}
	if ((st.st_uid != uid || st.st_gid != gid) && fchown(fd, uid, gid) != 0) {
		snprintf(err, errlen, "cannot chown %s/%s to %u:%u: %s", root, name, (unsigned)uid,
			 (unsigned)gid, strerror(errno));
		close(fd);
		return -1;
	}
	if ((st.st_mode & 07777) != 0700 && fchmod(fd, 0700) != 0) {
		snprintf(err, errlen, "cannot chmod %s/%s: %s", root, name, strerror(errno));
		close(fd);
		return -1;
	}
	close(fd);
	n = snprintf(out, outlen, "%s/%s", root, name);
	if (n < 0 || (size_t)n >= outlen) {
		snprintf(err, errlen, "ring dir path too long");
		return -1;
	}
	return 0;
}
