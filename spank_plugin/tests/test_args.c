/*
 * test_args.c - the plugin's decisions without Slurm: plugstack.conf
 * arguments, option values, partition defaults, LD_PRELOAD/PYTHONPATH
 * editing, and (as root) the ring directory's ownership and refusals.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../sg_plugin.h"
#include "../sg_ring.h"
#include "check.h"

struct sg_state sg;

static int parse(const char *line, struct sg_config *cfg, char *err, size_t errlen)
{
	char *copy = strdup(line), *av[16], *tok, *save = NULL;
	int ac = 0, rc;

	for (tok = strtok_r(copy, " ", &save); tok && ac < 16; tok = strtok_r(NULL, " ", &save))
		av[ac++] = tok;
	rc = sg_args_parse(ac, av, cfg, err, errlen);
	free(copy);
	return rc;
}

static void test_args(void)
{
	struct sg_config c;
	char err[512];

	CHECK(parse("nccl_hook=/opt/sg/libslurmguard_nccl.so", &c, err, sizeof(err)) == 0, "%s",
	      err);
	CHECK(strcmp(c.ring_root, "/dev/shm/slurmguard") == 0, "default ring root %s", c.ring_root);
	CHECK(c.default_on == 0 && c.allow_opt_out == 1 && c.ring_records == 65536 &&
		      c.partitions == NULL && c.torch_hook == NULL,
	      "defaults");
	sg_config_free(&c);

	CHECK(parse("nccl_hook=/a/h.so torch_hook=/a/site ring_root=/run/sg default=on "
		    "allow_opt_out=no partitions=gpu,debug ring_records=1024",
		    &c, err, sizeof(err)) == 0,
	      "%s", err);
	CHECK(c.nccl_profiler == NULL, "no profiler unless configured");
	CHECK(strcmp(c.torch_hook, "/a/site") == 0 && strcmp(c.ring_root, "/run/sg") == 0 &&
		      c.default_on == 1 && c.allow_opt_out == 0 &&
		      strcmp(c.partitions, "gpu,debug") == 0 && c.ring_records == 1024,
	      "all keys");
	sg_config_free(&c);

	/* the profiler plugin alone is enough (NCCL >= 2.27 only, no LD_PRELOAD) */
	CHECK(parse("nccl_profiler=/opt/sg/libslurmguard_nccl_profiler.so", &c, err,
		    sizeof(err)) == 0 &&
		      strcmp(c.nccl_profiler, "/opt/sg/libslurmguard_nccl_profiler.so") == 0 &&
		      c.nccl_hook == NULL,
	      "profiler only: %s", err);
	sg_config_free(&c);
	CHECK(parse("nccl_hook=/a/h.so nccl_profiler=lib.so", &c, err, sizeof(err)) != 0 &&
		      strstr(err, "nccl_profiler=lib.so: must be an absolute path"),
	      "relative profiler: %s", err);

	/* every bad line is refused with a message naming the argument */
	CHECK(parse("nccl_hook=/a/h.so colour=blue", &c, err, sizeof(err)) != 0 &&
		      strstr(err, "unknown argument 'colour=blue'"),
	      "unknown: %s", err);
	CHECK(parse("nccl_hook=/a/h.so verbose", &c, err, sizeof(err)) != 0 &&
		      strstr(err, "expected key=value"),
	      "no '=': %s", err);
	CHECK(parse("nccl_hook=relative.so", &c, err, sizeof(err)) != 0 && strstr(err, "absolute"),
	      "relative: %s", err);
	CHECK(parse("nccl_hook=/a/b.so:/evil.so", &c, err, sizeof(err)) != 0 && strstr(err, "':'"),
	      "separator: %s", err);
	CHECK(parse("torch_hook=/a/../etc", &c, err, sizeof(err)) != 0 && strstr(err, "normalised"),
	      "dotdot: %s", err);
	CHECK(parse("nccl_hook=/a/h.so default=maybe", &c, err, sizeof(err)) != 0 &&
		      strstr(err, "default=maybe"),
	      "bool: %s", err);
	CHECK(parse("nccl_hook=/a/h.so ring_records=1000", &c, err, sizeof(err)) != 0 &&
		      strstr(err, "power of two"),
	      "records: %s", err);
	CHECK(parse("ring_root=/dev/shm/x", &c, err, sizeof(err)) != 0 && strstr(err, "nccl_hook") &&
		      strstr(err, "nccl_profiler"),
	      "no hook: %s", err);
	CHECK(parse("nccl_hook=", &c, err, sizeof(err)) != 0 && strstr(err, "empty"), "empty: %s",
	      err);
}

static void test_choice(void)
{
	struct sg_config c = { 0 };
	enum sg_choice v;

	CHECK(sg_option_value(NULL, &v) == 0 && v == SG_OPT_ON, "bare flag");
	CHECK(sg_option_value("on", &v) == 0 && v == SG_OPT_ON, "on");
	CHECK(sg_option_value("(null)", &v) == 0 && v == SG_OPT_ON, "flag passed on by sbatch");
	CHECK(sg_option_value("off", &v) == 0 && v == SG_OPT_OFF, "off");
	CHECK(sg_option_value("sometimes", &v) != 0, "bad value accepted");

	c.allow_opt_out = 1;
	CHECK(!sg_should_guard(&c, SG_OPT_UNSET, "debug"), "default off");
	CHECK(sg_should_guard(&c, SG_OPT_ON, "debug"), "asked");
	c.default_on = 1;
	CHECK(sg_should_guard(&c, SG_OPT_UNSET, "debug"), "default on");
	CHECK(!sg_should_guard(&c, SG_OPT_OFF, "debug"), "opt out");
	c.allow_opt_out = 0;
	CHECK(sg_should_guard(&c, SG_OPT_OFF, "debug"), "opt out refused");
	c.partitions = "gpu,debug";
	CHECK(sg_should_guard(&c, SG_OPT_UNSET, "debug"), "listed partition");
	CHECK(!sg_should_guard(&c, SG_OPT_UNSET, "cpu"), "other partition");
	CHECK(!sg_should_guard(&c, SG_OPT_OFF, "cpu"), "opt out elsewhere");
	CHECK(sg_should_guard(&c, SG_OPT_ON, "cpu"), "asked elsewhere");
	CHECK(sg_partition_matches("gpu,debug", "cpu,gpu"), "multi-partition job");
	CHECK(!sg_partition_matches("gpu,debug", "gp"), "prefix is no match");
	CHECK(!sg_partition_matches("gpu", ""), "no partition");
}

static void check_path(const char *cur, const char *entry, const char *seps, int prepend,
		       const char *want)
{
	char *got = prepend ? sg_path_prepend(cur, entry, seps) : sg_path_remove(cur, entry, seps);

	CHECK(got && strcmp(got, want) == 0, "%s(%s, %s) = '%s', want '%s'",
	      prepend ? "prepend" : "remove", cur ? cur : "NULL", entry, got ? got : "NULL", want);
	free(got);
}

static void test_paths(void)
{
	const char *h = "/opt/sg/hook.so";

	check_path(NULL, h, ": \t", 1, "/opt/sg/hook.so");
	check_path("", h, ": \t", 1, "/opt/sg/hook.so");
	check_path("/u/a.so", h, ": \t", 1, "/opt/sg/hook.so:/u/a.so");
	/* ld.so splits on spaces too; the user's entries are kept in order */
	check_path("/u/a.so /u/b.so:/u/c.so", h, ": \t", 1,
		   "/opt/sg/hook.so:/u/a.so:/u/b.so:/u/c.so");
	/* never twice, and always first */
	check_path("/u/a.so:/opt/sg/hook.so", h, ": \t", 1, "/opt/sg/hook.so:/u/a.so");
	check_path("/opt/sg/hook.so:/u/a.so", h, ": \t", 0, "/u/a.so");
	check_path("/opt/sg/hook.so", h, ": \t", 0, "");
	/* a longer name that starts like ours is someone else's */
	check_path("/opt/sg/hook.so.bak", h, ": \t", 0, "/opt/sg/hook.so.bak");
	/* PYTHONPATH: empty entries mean the current directory; keep them */
	check_path("/u/lib::/u/x", "/sg/site", ":", 1, "/sg/site:/u/lib::/u/x");
	check_path("/u/lib:", "/sg/site", ":", 1, "/sg/site:/u/lib:");
	check_path("/sg/site:/u/lib", "/sg/site", ":", 0, "/u/lib");
}

static void test_ringdir(void)
{
	char root[] = "/tmp/sg-test-ringdir-XXXXXX";
	char sub[256], out[4096], err[512], link[512];
	struct stat st;

	if (geteuid() != 0) {
		printf("test_args: not root, ring directory ownership checks skipped\n");
		return;
	}
	if (!mkdtemp(root))
		return;
	chmod(root, 0755);
	snprintf(sub, sizeof(sub), "%s/shm/slurmguard", root);
	CHECK(sg_make_job_dir(sub, 123, 65534, 65534, out, sizeof(out), err, sizeof(err)) == 0,
	      "%s", err);
	snprintf(link, sizeof(link), "%s/123", sub);
	CHECK(strcmp(out, link) == 0, "dir %s", out);
	CHECK(stat(out, &st) == 0 && st.st_uid == 65534 && st.st_gid == 65534 &&
		      (st.st_mode & 07777) == 0700,
	      "owner %u mode %o", st.st_uid, st.st_mode & 07777);
	CHECK(stat(sub, &st) == 0 && st.st_uid == 0 && (st.st_mode & 07777) == 0755,
	      "root mode %o", st.st_mode & 07777);
	/* the second node on this host / the next step: same answer */
	CHECK(sg_make_job_dir(sub, 123, 65534, 65534, out, sizeof(out), err, sizeof(err)) == 0,
	      "again: %s", err);
	/* another user's job with a recycled id is refused */
	CHECK(sg_make_job_dir(sub, 123, 1000, 1000, out, sizeof(out), err, sizeof(err)) != 0 &&
		      strstr(err, "belongs to uid 65534"),
	      "foreign dir: %s", err);
	/* a world-writable root (e.g. pre-created by a user) is refused */
	chmod(sub, 0777);
	CHECK(sg_make_job_dir(sub, 124, 65534, 65534, out, sizeof(out), err, sizeof(err)) != 0 &&
		      strstr(err, "refusing"),
	      "writable root: %s", err);
	chmod(sub, 0755);
	/* a symlinked job dir is not followed */
	snprintf(link, sizeof(link), "%s/125", sub);
	CHECK(symlink("/etc", link) == 0, "symlink");
	CHECK(sg_make_job_dir(sub, 125, 65534, 65534, out, sizeof(out), err, sizeof(err)) != 0,
	      "symlink followed");
	CHECK(lstat("/etc", &st) == 0 && st.st_uid == 0, "/etc changed owner!");
	unlink(link);
	snprintf(link, sizeof(link), "%s/123", sub);
	rmdir(link);
	rmdir(sub);
	snprintf(link, sizeof(link), "%s/shm", root);
	rmdir(link);
	rmdir(root);
}

int main(void)
{
	char buf[16];

	test_args();
	test_choice();
	test_paths();
	test_ringdir();
	CHECK(strcmp(sg_step_name(0xfffffffbU, buf, sizeof(buf)), "batch") == 0, "batch");
	CHECK(strcmp(sg_step_name(3, buf, sizeof(buf)), "3") == 0, "step 3");
	DONE("test_args");
}
