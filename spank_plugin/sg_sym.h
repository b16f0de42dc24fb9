/*
 * sg_sym.h - find a function in a library the process already loaded,
 * never loading one: the NCCL hook's real NCCL functions (nccl_hook.c) and
 * the CUDA runtime the job uses (gpu_timing.c) are found the same way.
 */
#ifndef SG_SYM_H
#define SG_SYM_H

/*
 * `name` from `first` (RTLD_NEXT or RTLD_DEFAULT, as the caller means it),
 * else from the first already-loaded library of env_var's value (an
 * absolute path or soname, optional) and then of libs (NULL-terminated),
 * each asked through dlopen(RTLD_NOLOAD): a library loaded RTLD_LOCAL (a
 * framework's dependency) is not in the global scope, and a second copy
 * must never be loaded. A hit equal to `self` (our own interposer) is
 * skipped. NULL when none has it. errno is left unchanged.
 */
void *sg_sym_loaded(const char *name, void *first, const char *env_var,
		    const char *const *libs, void *self);

#endif
