/*
 * local.c - srun (local context) and sbatch/salloc (allocator context).
 *
 * Nothing is instrumented here; the choice travels to slurmstepd with the
 * job's SPANK options. The job control environment gets SPANK_SLURMGUARD so
 * the prolog/epilog can tell a job asked for the guard.
 */
#include <slurm/spank.h>

#include "sg_plugin.h"

int sg_local_post_opt(spank_t sp)
{
	if (sg.choice == SG_OPT_UNSET)
		return 0;
	if (sg.choice == SG_OPT_ON && !sg.config_ok) {
		slurm_spank_log("slurmguard: --%s ignored: the plugin is not configured on this "
				"cluster (see the slurmd log)", SG_OPTION_NAME);
		return 0;
	}
	/* best effort: older Slurm may refuse in the allocator context */
	spank_job_control_setenv(sp, "SLURMGUARD", sg.choice == SG_OPT_ON ? "on" : "off", 1);
	return 0;
}
