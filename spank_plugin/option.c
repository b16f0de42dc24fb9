/*
 * option.c - the --straggler-guard[=on|off] option.
 *
 * The callback only validates the value and records the choice; whatever
 * follows from it happens later, in the context that owns it. It may run
 * several times (command line, environment, remote side): the last value
 * wins, so it is idempotent.
 */
#include <stdio.h>
#include <slurm/spank.h>

#include "sg_plugin.h"

static char usage[256];

static int option_cb(int val, const char *optarg, int remote)
{
	enum sg_choice choice;

	(void)val;
	if (sg_option_value(optarg, &choice) != 0) {
		slurm_error("slurmguard: --%s=%s: expected on or off", SG_OPTION_NAME, optarg);
		return -1;
	}
	/* refused where the user can read the message; on the remote side
	 * the admin default simply stands (see sg_should_guard) */
	if (choice == SG_OPT_OFF && sg.config_ok && !sg.cfg.allow_opt_out && !remote) {
		slurm_error("slurmguard: --%s=off: opting out is not allowed on this cluster",
			    SG_OPTION_NAME);
		return -1;
	}
	sg.choice = choice;
	return 0;
}

static struct spank_option option = {
	SG_OPTION_NAME, "on|off", usage, 2, 0, option_cb,
};

int sg_option_register(spank_t sp)
{
	spank_err_t rc;

	snprintf(usage, sizeof(usage),
		 "Time this job's collectives (NCCL, torch.distributed) so slurmguard can find "
		 "slow nodes; =off to opt out. Default here: %s.",
		 !sg.config_ok ? "off (not configured)" :
		 !sg.cfg.default_on ? "off" :
		 sg.cfg.partitions ? "on in some partitions" : "on");
	rc = spank_option_register(sp, &option);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("slurmguard: cannot register --%s: %s", SG_OPTION_NAME,
			    spank_strerror(rc));
		return -1;
	}
	return 0;
}
