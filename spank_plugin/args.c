/*
 * args.c - the plugstack.conf arguments and the other decisions the plugin
 * makes from strings. No Slurm calls here, so tests/test_args.c can check
 * every rule directly.
 *
 * plugstack.conf line:
 *   optional /path/slurmguard_spank.so nccl_hook=/abs/libslurmguard_nccl.so \
 *       nccl_profiler=/abs/libslurmguard_nccl_profiler.so \
 *       torch_hook=/abs/dir ring_root=/dev/shm/slurmguard default=off \
 *       allow_opt_out=yes partitions=gpu,debug ring_records=65536
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg_plugin.h"
#include "sg_ring.h"

static int fail(char *err, size_t errlen, const char *fmt, const char *a, const char *b)
{
	snprintf(err, errlen, fmt, a, b);
	return -1;
}

/* An admin path that will be spliced into LD_PRELOAD / PYTHONPATH / file
 * names: absolute, no separators, no whitespace, no "." or ".." parts. */
static int check_path(const char *key, const char *v, char *err, size_t errlen)
{
	const char *p;

	if (v[0] != '/')
		return fail(err, errlen, "%s=%s: must be an absolute path", key, v);
	if (strlen(v) >= 1024)
		return fail(err, errlen, "%s=%.60s...: path too long", key, v);
	for (p = v; *p; p++) {
		if (*p == ':' || *p == ' ' || *p == '\t' || *p == '\n' || *p == ',' || *p == '=')
			return fail(err, errlen, "%s=%s: path must not contain ':', ',', '=' or spaces",
				    key, v);
	}
	if (strstr(v, "/./") || strstr(v, "/../") || strstr(v, "//") ||
	    (strlen(v) >= 2 && strcmp(v + strlen(v) - 2, "/.") == 0) ||
	    (strlen(v) >= 3 && strcmp(v + strlen(v) - 3, "/..") == 0))
		return fail(err, errlen, "%s=%s: path must be normalised (no '.', '..', '//')", key,
			    v);
	return 0;
}

static int parse_bool(const char *key, const char *v, const char *yes, const char *no, int *out,
		      char *err, size_t errlen)
{
	if (strcmp(v, yes) == 0 || strcmp(v, "yes") == 0 || strcmp(v, "on") == 0 ||
	    strcmp(v, "1") == 0 || strcmp(v, "true") == 0) {
		*out = 1;
		return 0;
	}
	if (strcmp(v, no) == 0 || strcmp(v, "no") == 0 || strcmp(v, "off") == 0 ||
	    strcmp(v, "0") == 0 || strcmp(v, "false") == 0) {
		*out = 0;
		return 0;
	}
	snprintf(err, errlen, "%s=%s: expected %s or %s", key, v, yes, no);
	return -1;
}

static int set_str(char **slot, const char *v)
{
	char *copy = strdup(v);

	if (!copy)
		return -1;
	free(*slot);
	*slot = copy;
	return 0;
}

void sg_config_free(struct sg_config *cfg)
{
	free(cfg->nccl_hook);
	free(cfg->torch_hook);
	free(cfg->nccl_profiler);
	free(cfg->ring_root);
	free(cfg->partitions);
	memset(cfg, 0, sizeof(*cfg));
}

int sg_args_parse(int ac, char **av, struct sg_config *cfg, char *err, size_t errlen)
{
	int i;

	memset(cfg, 0, sizeof(*cfg));
	cfg->allow_opt_out = 1;
	cfg->ring_records = SG_RING_DEFAULT_CAPACITY;
	err[0] = '\0';
	for (i = 0; i < ac; i++) {
		const char *a = av[i];
		const char *eq = strchr(a, '=');
		char key[32];
		const char *v;
		size_t klen;

		if (!eq || eq == a)
			goto bad_syntax;
		klen = (size_t)(eq - a);
		if (klen >= sizeof(key))
			goto unknown;
		memcpy(key, a, klen);
		key[klen] = '\0';
		v = eq + 1;
		if (!*v) {
			fail(err, errlen, "%s: empty value%s", a, "");
			goto error;
		}
		if (strcmp(key, "nccl_hook") == 0 || strcmp(key, "torch_hook") == 0 ||
		    strcmp(key, "ring_root") == 0 || strcmp(key, "nccl_profiler") == 0) {
			char **slot = strcmp(key, "nccl_hook") == 0 ? &cfg->nccl_hook :
				      strcmp(key, "torch_hook") == 0 ? &cfg->torch_hook :
				      strcmp(key, "nccl_profiler") == 0 ? &cfg->nccl_profiler :
				      &cfg->ring_root;

			if (check_path(key, v, err, errlen) || set_str(slot, v))
				goto error;
		} else if (strcmp(key, "default") == 0) {
			if (parse_bool(key, v, "on", "off", &cfg->default_on, err, errlen))
				goto error;
		} else if (strcmp(key, "allow_opt_out") == 0) {
			if (parse_bool(key, v, "yes", "no", &cfg->allow_opt_out, err, errlen))
				goto error;
		} else if (strcmp(key, "partitions") == 0) {
			const char *p;

			for (p = v; *p; p++) {
				if (*p == ' ' || *p == ':' || *p == '=') {
					fail(err, errlen, "partitions=%s: expected name,name,...%s", v,
					     "");
					goto error;
				}
			}
			if (set_str(&cfg->partitions, v))
				goto error;
		} else if (strcmp(key, "ring_records") == 0) {
			char *end;
			unsigned long long n;

			errno = 0;
			n = strtoull(v, &end, 10);
			if (errno || *end || n < SG_RING_MIN_CAPACITY || n > SG_RING_MAX_CAPACITY ||
			    (n & (n - 1)) != 0) {
				snprintf(err, errlen,
					 "ring_records=%s: expected a power of two in [%u, %u]", v,
					 SG_RING_MIN_CAPACITY, SG_RING_MAX_CAPACITY);
				goto error;
			}
			cfg->ring_records = (uint32_t)n;
		} else {
			goto unknown;
		}
	}
	if (!cfg->nccl_hook && !cfg->torch_hook && !cfg->nccl_profiler) {
		snprintf(err, errlen,
			 "need at least one of nccl_hook=PATH, nccl_profiler=PATH, torch_hook=DIR");
		goto error;
	}
	if (!cfg->ring_root && set_str(&cfg->ring_root, SG_DEFAULT_RING_ROOT))
		goto error;
	return 0;

bad_syntax:
	fail(err, errlen, "argument '%s': expected key=value%s", av[i], "");
	goto error;
unknown:
	fail(err, errlen,
	     "unknown argument '%s' (known: nccl_hook, nccl_profiler, torch_hook, ring_root, "
	     "default, allow_opt_out, partitions, ring_records)%s",
	     av[i], "");
error:
	if (!err[0])
		snprintf(err, errlen, "out of memory");
	sg_config_free(cfg);
	return -1;
}

int sg_option_value(const char *optarg, enum sg_choice *out)
{
	/* "(null)": how Slurm 22.05 passes a bare flag to job steps through
	 * SLURM_SPANK__SLURM_SPANK_OPTION_* (it printf's a NULL optarg) */
	if (!optarg || !*optarg || strcmp(optarg, "(null)") == 0 || strcmp(optarg, "on") == 0 || strcmp(optarg, "yes") == 0 ||
	    strcmp(optarg, "1") == 0) {
		*out = SG_OPT_ON;
		return 0;
	}
	if (strcmp(optarg, "off") == 0 || strcmp(optarg, "no") == 0 || strcmp(optarg, "0") == 0) {
		*out = SG_OPT_OFF;
		return 0;
	}
	return -1;
}

/* list "a,b,c" contains partition; a job may name several partitions */
int sg_partition_matches(const char *list, const char *partition)
{
	const char *p, *q;

	if (!list)
		return 1;
	if (!partition || !*partition)
		return 0;
	for (q = partition; *q;) {
		size_t qlen = strcspn(q, ",");

		for (p = list; *p;) {
			size_t plen = strcspn(p, ",");

			if (plen == qlen && plen > 0 && strncmp(p, q, plen) == 0)
				return 1;
			p += plen;
			if (*p == ',')
				p++;
		}
		q += qlen;
		if (*q == ',')
			q++;
	}
	return 0;
}

int sg_should_guard(const struct sg_config *cfg, enum sg_choice choice, const char *partition)
{
	int by_default = cfg->default_on && sg_partition_matches(cfg->partitions, partition);

	switch (choice) {
	case SG_OPT_ON:
		return 1;
	case SG_OPT_OFF:
		return by_default && !cfg->allow_opt_out;
	default:
		return by_default;
	}
}

static int is_sep(char c, const char *seps)
{
	return c && strchr(seps, c) != NULL;
}

/*
 * Rebuild a search-path list with `entry` removed (and, for prepend, put
 * first). Other entries keep their order; the result is ':'-joined. With
 * keep_empty, empty entries survive (an empty PYTHONPATH entry means the
 * current directory); LD_PRELOAD drops them as ld.so does.
 */
static char *rebuild(const char *current, const char *entry, const char *seps, int prepend)
{
	size_t cap = (current ? strlen(current) : 0) + strlen(entry) + 2;
	size_t elen = strlen(entry);
	int keep_empty = strchr(seps, ' ') == NULL;
	char *out = malloc(cap);
	const char *p = current;
	size_t len = 0;
	int first = 1;

	if (!out)
		return NULL;
	out[0] = '\0';
	if (prepend) {
		memcpy(out, entry, elen + 1);
		len = elen;
		first = 0;
	}
	while (p && *p) {
		const char *start = p;
		size_t n;

		while (*p && !is_sep(*p, seps))
			p++;
		n = (size_t)(p - start);
		if (!(n == elen && strncmp(start, entry, n) == 0) && (n > 0 || keep_empty)) {
			if (!first)
				out[len++] = ':';
			memcpy(out + len, start, n);
			len += n;
			out[len] = '\0';
			first = 0;
		}
		if (!*p)
			break;
		p++;
		if (!*p && keep_empty) {
			/* a trailing separator is a trailing empty entry */
			if (!first)
				out[len++] = ':';
			out[len] = '\0';
		}
	}
	return out;
}

char *sg_path_prepend(const char *current, const char *entry, const char *seps)
{
	return rebuild(current, entry, seps, 1);
}

char *sg_path_remove(const char *current, const char *entry, const char *seps)
{
	return rebuild(current, entry, seps, 0);
}

