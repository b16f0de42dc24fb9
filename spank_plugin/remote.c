/*
 * remote.c - slurmstepd (remote context).
 *
 * init_post_opt (still root): decide whether this step is guarded and
 * create <ring_root>/<jobid> owned by the job's user, mode 0700.
 * user_init: put the NCCL hook first in LD_PRELOAD and the torch hook
 * first in PYTHONPATH (keeping the user's entries), set NCCL_PROFILER_PLUGIN
 * to the profiler plugin, and export the SLURMGUARD_* variables. All paths
 * come from plugstack.conf; values the user set for the SLURMGUARD_*
 * variables are overwritten. A profiler plugin of the user's own
 * (NCCL_PROFILER_PLUGIN already set to something else) is kept: NCCL loads
 * one profiler only, and the preloaded hook then records as on older NCCL.
 *
 * A step that is not guarded but inherited the hooks (srun
 * --straggler-guard=off inside a guarded batch script) gets them removed;
 * otherwise an unguarded step's environment is not touched.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <slurm/spank.h>

#include "sg_plugin.h"
#include "sg_ring.h"

#define ENV_BUF (64 * 1024)

static const char *const exported[] = {
	"SLURMGUARD_RING_DIR", "SLURMGUARD_JOB_ID",     "SLURMGUARD_STEP_ID",
	"SLURMGUARD_NCCL_HOOK", "SLURMGUARD_RING_RECORDS", NULL,
};

static int usable_file(const char *path, int want_dir)
{
	struct stat st;

	if (!path || stat(path, &st) != 0)
		return 0;
	return want_dir ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode);
}

int sg_remote_post_opt(spank_t sp)
{
	char partition[256], err[512], sbuf[16];
	uid_t uid;
	gid_t gid;

	sg.guarded = 0;
	if (!sg.config_ok)
		return 0;
	if (spank_get_item(sp, S_JOB_ID, &sg.job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &sg.step_id) != ESPANK_SUCCESS)
		return 0;
	if (sg.step_id == SG_STEP_EXTERN)
		return 0;
	if (spank_getenv(sp, "SLURM_JOB_PARTITION", partition, sizeof(partition)) != ESPANK_SUCCESS)
		partition[0] = '\0';
	if (!sg_should_guard(&sg.cfg, sg.choice, partition))
		return 0;
	if (spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &gid) != ESPANK_SUCCESS) {
		slurm_error("slurmguard: job %u: cannot get the job's uid/gid; not guarded",
			    sg.job_id);
		return 0;
	}
	if (sg.cfg.nccl_hook && !usable_file(sg.cfg.nccl_hook, 0))
		slurm_error("slurmguard: nccl_hook=%s is not a file; NCCL calls will not be timed",
			    sg.cfg.nccl_hook);
	if (sg.cfg.nccl_profiler && !usable_file(sg.cfg.nccl_profiler, 0))
		slurm_error("slurmguard: nccl_profiler=%s is not a file; NCCL will run without it",
			    sg.cfg.nccl_profiler);
	if (sg.cfg.torch_hook && !usable_file(sg.cfg.torch_hook, 1))
		slurm_error("slurmguard: torch_hook=%s is not a directory; torch.distributed calls "
			    "will not be timed", sg.cfg.torch_hook);
	if (sg_make_job_dir(sg.cfg.ring_root, sg.job_id, uid, gid, sg.ring_dir,
			    sizeof(sg.ring_dir), err, sizeof(err)) != 0) {
		slurm_error("slurmguard: job %u: %s; not guarded", sg.job_id, err);
		return 0;
	}
	sg.guarded = 1;
	slurm_info("slurmguard: job %u step %s guarded, rings in %s", sg.job_id,
		   sg_step_name(sg.step_id, sbuf, sizeof(sbuf)), sg.ring_dir);
	return 0;
}

/* Rewrite a search-path variable with `entry` first (prepend) or removed. */
static void edit_path_var(spank_t sp, const char *var, const char *entry, const char *seps,
			  int prepend)
{
	char *cur = malloc(ENV_BUF), *next;
	spank_err_t rc;
	int present;

	if (!cur)
		return;
	rc = spank_getenv(sp, var, cur, ENV_BUF);
	if (rc == ESPANK_NOSPACE) {
		slurm_error("slurmguard: job %u: %s longer than %d bytes; left unchanged", sg.job_id,
			    var, ENV_BUF);
		free(cur);
		return;
	}
	present = rc == ESPANK_SUCCESS;
	if (!prepend && (!present || !strstr(cur, entry))) {
		free(cur);
		return;
	}
	next = prepend ? sg_path_prepend(present ? cur : NULL, entry, seps) :
			 sg_path_remove(cur, entry, seps);
	if (next && *next)
		spank_setenv(sp, var, next, 1);
	else if (next)
		spank_unsetenv(sp, var);
	free(next);
	free(cur);
}

static void set_num(spank_t sp, const char *var, unsigned long v)
{
	char buf[32];

	snprintf(buf, sizeof(buf), "%lu", v);
	spank_setenv(sp, var, buf, 1);
}

/* NCCL_PROFILER_PLUGIN is ours (or unset) */
static int profiler_is_ours(spank_t sp)
{
	char cur[1100];
	spank_err_t rc = spank_getenv(sp, "NCCL_PROFILER_PLUGIN", cur, sizeof(cur));

	return rc == ESPANK_SUCCESS && strcmp(cur, sg.cfg.nccl_profiler) == 0;
}

static void set_profiler(spank_t sp)
{
	char cur[1100];
	spank_err_t rc = spank_getenv(sp, "NCCL_PROFILER_PLUGIN", cur, sizeof(cur));

	if (rc == ESPANK_NOSPACE ||
	    (rc == ESPANK_SUCCESS && cur[0] && strcmp(cur, sg.cfg.nccl_profiler) != 0)) {
		slurm_info("slurmguard: job %u: the job set NCCL_PROFILER_PLUGIN itself; kept (NCCL "
			   "calls timed by the LD_PRELOAD hook where configured)", sg.job_id);
		return;
	}
	spank_setenv(sp, "NCCL_PROFILER_PLUGIN", sg.cfg.nccl_profiler, 1);
}

int sg_remote_user_init(spank_t sp)
{
	int i;

	if (!sg.config_ok)
		return 0;
	if (!sg.guarded) {
		/* strip what a guarded parent step may have left us */
		if (sg.cfg.nccl_hook)
			edit_path_var(sp, "LD_PRELOAD", sg.cfg.nccl_hook, ": \t", 0);
		if (sg.cfg.torch_hook)
			edit_path_var(sp, "PYTHONPATH", sg.cfg.torch_hook, ":", 0);
		if (sg.cfg.nccl_profiler && profiler_is_ours(sp))
			spank_unsetenv(sp, "NCCL_PROFILER_PLUGIN");
		for (i = 0; exported[i]; i++) {
			char probe[8];

			if (spank_getenv(sp, exported[i], probe, sizeof(probe)) != ESPANK_ENV_NOEXIST)
				spank_unsetenv(sp, exported[i]);
		}
		return 0;
	}
	if (sg.cfg.nccl_hook) {
		edit_path_var(sp, "LD_PRELOAD", sg.cfg.nccl_hook, ": \t", 1);
		spank_setenv(sp, "SLURMGUARD_NCCL_HOOK", sg.cfg.nccl_hook, 1);
	} else {
		spank_unsetenv(sp, "SLURMGUARD_NCCL_HOOK");
	}
	if (sg.cfg.torch_hook)
		edit_path_var(sp, "PYTHONPATH", sg.cfg.torch_hook, ":", 1);
	if (sg.cfg.nccl_profiler)
		set_profiler(sp);
	spank_setenv(sp, "SLURMGUARD_RING_DIR", sg.ring_dir, 1);
	set_num(sp, "SLURMGUARD_JOB_ID", sg.job_id);
	set_num(sp, "SLURMGUARD_STEP_ID", sg.step_id);
	set_num(sp, "SLURMGUARD_RING_RECORDS", sg.cfg.ring_records);
	return 0;
}
