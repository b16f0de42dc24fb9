/*
 * plugin.c - slurmguard's SPANK plugin: the entry points Slurm calls, each
 * handing over to the file that owns its context (see sg_plugin.h).
 *
 * The plugin never fails a job because instrumentation could not be set
 * up: such problems are logged and the job runs unguarded. Only a broken
 * plugstack.conf line makes slurm_spank_init fail, which stops jobs when
 * the admin marked the plugin `required` and is ignored when `optional`.
 */
#include <slurm/spank.h>

#include "sg_plugin.h"

SPANK_PLUGIN(slurmguard, 1);

struct sg_state sg;

/* option.c, local.c, remote.c */
int sg_option_register(spank_t sp);
int sg_local_post_opt(spank_t sp);
int sg_remote_post_opt(spank_t sp);
int sg_remote_user_init(spank_t sp);

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();
	char err[512];
	int rc = 0;

	sg_config_free(&sg.cfg);
	sg.config_ok = sg_args_parse(ac, av, &sg.cfg, err, sizeof(err)) == 0;
	if (!sg.config_ok) {
		slurm_error("slurmguard: plugstack.conf: %s; jobs run without straggler guard", err);
		rc = -1;
	}
	/* registered even with a bad line, so --straggler-guard in users'
	 * scripts is never an "unrecognized option" */
	if (ctx == S_CTX_LOCAL || ctx == S_CTX_REMOTE || ctx == S_CTX_ALLOCATOR) {
		if (sg_option_register(sp) != 0)
			rc = -1;
	}
	return rc;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return sg_local_post_opt(sp);
	case S_CTX_REMOTE:
		return sg_remote_post_opt(sp);
	default:
		return 0;
	}
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return sg_remote_user_init(sp);
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	sg_config_free(&sg.cfg);
	return 0;
}
