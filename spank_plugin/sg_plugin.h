/*
 * sg_plugin.h - state and helpers shared by the SPANK plugin's files.
 *
 * plugin.c  thin dispatcher: the slurm_spank_* entry points
 * args.c    plugstack.conf arguments, option values, pure helpers
 * option.c  --straggler-guard registration and callback (validate, record)
 * local.c   srun / sbatch / salloc (local and allocator contexts)
 * remote.c  slurmstepd: ring directory and the tasks' environment
 * ringdir.c creation of <ring_root>/<jobid> owned by the job's user
 */
#ifndef SG_PLUGIN_H
#define SG_PLUGIN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define SG_OPTION_NAME "straggler-guard"
#define SG_DEFAULT_RING_ROOT "/dev/shm/slurmguard"

/* the user's choice on the command line */
enum sg_choice { SG_OPT_UNSET = 0, SG_OPT_ON = 1, SG_OPT_OFF = 2 };

/* admin settings from the plugstack.conf line */
struct sg_config {
	char *nccl_hook;      /* nccl_hook=ABS: the NCCL LD_PRELOAD library */
	char *torch_hook;     /* torch_hook=ABS: dir with the torch hook's sitecustomize.py */
	char *nccl_profiler;  /* nccl_profiler=ABS: libslurmguard_nccl_profiler.so, set as
			       * NCCL_PROFILER_PLUGIN (NCCL >= 2.27 then records through it
			       * and a preloaded hook stands down) */
	char *ring_root;      /* ring_root=ABS: per-job ring dirs below (SG_DEFAULT_RING_ROOT) */
	int default_on;       /* default=on|off: guard jobs that do not ask (off) */
	int allow_opt_out;    /* allow_opt_out=yes|no: may users say =off (yes) */
	char *partitions;     /* partitions=a,b: where default=on applies (all) */
	uint32_t ring_records; /* ring_records=N: records per rank ring (65536) */
};

struct sg_state {
	struct sg_config cfg;
	int config_ok;        /* the plugstack.conf line parsed cleanly */
	enum sg_choice choice;
	int guarded;          /* remote: this step is instrumented */
	char ring_dir[4096];  /* remote: <ring_root>/<jobid> */
	uint32_t job_id;
	uint32_t step_id;
};

extern struct sg_state sg;

/* args.c (pure: no Slurm calls, unit-tested by tests/test_args.c) */
int sg_args_parse(int ac, char **av, struct sg_config *cfg, char *err, size_t errlen);
void sg_config_free(struct sg_config *cfg);
int sg_option_value(const char *optarg, enum sg_choice *out);
int sg_partition_matches(const char *list, const char *partition);
int sg_should_guard(const struct sg_config *cfg, enum sg_choice choice, const char *partition);
char *sg_path_prepend(const char *current, const char *entry, const char *seps);
char *sg_path_remove(const char *current, const char *entry, const char *seps);

/* ringdir.c */
int sg_make_job_dir(const char *root, uint32_t job_id, uid_t uid, gid_t gid, char *out,
		    size_t outlen, char *err, size_t errlen);

#endif
