/* sg_sym.c - see sg_sym.h */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>

#include "sg_sym.h"

static void *from_loaded(const char *lib, const char *name, void *self)
{
	void *handle, *p;

	if (!lib || !*lib)
		return NULL;
	handle = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
	if (!handle)
		return NULL;
	p = dlsym(handle, name);
	dlclose(handle); /* drops the reference NOLOAD took; the library stays */
	return p != self ? p : NULL;
}

void *sg_sym_loaded(const char *name, void *first, const char *env_var,
		    const char *const *libs, void *self)
{
	int saved = errno;
	void *p = dlsym(first, name);

	if (!p || p == self) {
		p = from_loaded(env_var ? getenv(env_var) : NULL, name, self);
		for (; !p && libs && *libs; libs++)
			p = from_loaded(*libs, name, self);
	}
	errno = saved;
	return p != self ? p : NULL;
}
