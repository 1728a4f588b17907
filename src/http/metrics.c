/* metrics.c — the metrics registry: families of counters, gauges and histograms, each with label
 * names and one series per distinct label-value tuple, rendered as Prometheus text exposition
 * format 0.0.4. One mutex per registry guards everything; observations are a lookup plus an add,
 * so contention is negligible next to an HTTP request or a decode step. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

typedef struct {
    uint64_t hash;
    char **values;     /* n_labels strings */
    double value;      /* counter / gauge */
    uint64_t *buckets; /* histogram: per-bucket (not cumulative) counts, n_bounds + 1 (+Inf) */
    double sum;
    uint64_t count;
} metric_series;

struct kvb_metric {
    kvb_metrics *registry;
    kvb_metric_type type;
    char *name, *help, *label_spec;
    size_t n_labels;
    char *label_names[KVB_METRIC_MAX_LABELS];
    double *bounds;
    size_t n_bounds;
    metric_series *series;
    size_t n_series, cap_series;
    bool warned_full;
};

struct kvb_metrics {
    pthread_mutex_t mu;
    kvb_metric **families;
    size_t n_families, cap_families;
};

static const double default_latency_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                0.5,   1,      2.5,   5,    10,    30,    60};

kvb_status kvb_metrics_create(kvb_metrics **out, kvb_err *err) {
    *out = NULL;
    kvb_metrics *m = calloc(1, sizeof *m);
    if (!m) return kvb_err_set(err, KVB_ERR_NOMEM, "metrics: out of memory");
    if (pthread_mutex_init(&m->mu, NULL) != 0) {
        free(m);
        return kvb_err_set(err, KVB_ERR_INTERNAL, "metrics: pthread_mutex_init failed");
    }
    *out = m;
    return KVB_OK;
}

static void family_free(kvb_metric *f) {
    for (size_t i = 0; i < f->n_series; i++) {
        for (size_t j = 0; j < f->n_labels; j++) free(f->series[i].values[j]);
        free(f->series[i].values);
        free(f->series[i].buckets);
    }
    free(f->series);
    for (size_t j = 0; j < f->n_labels; j++) free(f->label_names[j]);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f->label_spec);
    free(f);
}

void kvb_metrics_free(kvb_metrics *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n_families; i++) family_free(m->families[i]);
    free(m->families);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* ---- registration ---------------------------------------------------------------------------- */

static bool valid_metric_name(const char *s) {
    if (!s || !s[0]) return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
        if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return true;
}

static bool valid_label_name(const char *s, size_t n) {
    if (n == 0 || (n >= 2 && s[0] == '_' && s[1] == '_')) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return true;
}

static bool same_family(const kvb_metric *f, kvb_metric_type type, const char *labels,
                        const double *bounds, size_t n_bounds) {
    if (f->type != type || strcmp(f->label_spec, labels) != 0) return false;
    if (type != KVB_METRIC_HISTOGRAM) return true;
    if (f->n_bounds != n_bounds) return false;
    for (size_t i = 0; i < n_bounds; i++)
        if (f->bounds[i] != bounds[i]) return false;
    return true;
}

static kvb_status family_new(kvb_metric_type type, const char *name, const char *help,
                             const char *labels, const double *bounds, size_t n_bounds,
                             kvb_metric **out, kvb_err *err) {
    kvb_metric *f = calloc(1, sizeof *f);
    if (!f) return kvb_err_set(err, KVB_ERR_NOMEM, "metrics: out of memory");
    f->type = type;
    f->name = strdup(name);
    f->help = strdup(help ? help : "");
    f->label_spec = strdup(labels);
    if (!f->name || !f->help || !f->label_spec) goto nomem;
    for (const char *p = labels; *p;) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        if (!valid_label_name(p, n) || (type == KVB_METRIC_HISTOGRAM && n == 2 && memcmp(p, "le", 2) == 0)) {
            kvb_err_set(err, KVB_ERR_INVALID, "metrics: %s: invalid label name '%.*s'", name, (int)n, p);
            family_free(f);
            return KVB_ERR_INVALID;
        }
        if (f->n_labels == KVB_METRIC_MAX_LABELS) {
            kvb_err_set(err, KVB_ERR_INVALID, "metrics: %s: more than %d labels", name,
                        KVB_METRIC_MAX_LABELS);
            family_free(f);
            return KVB_ERR_INVALID;
        }
        f->label_names[f->n_labels] = strndup(p, n);
        if (!f->label_names[f->n_labels]) goto nomem;
        for (size_t j = 0; j < f->n_labels; j++) {
            if (strcmp(f->label_names[j], f->label_names[f->n_labels]) == 0) {
                kvb_err_set(err, KVB_ERR_INVALID, "metrics: %s: duplicate label '%s'", name,
                            f->label_names[j]);
                f->n_labels++;
                family_free(f);
                return KVB_ERR_INVALID;
            }
        }
        f->n_labels++;
        p += n;
        if (*p == ',') p++;
    }
    if (type == KVB_METRIC_HISTOGRAM) {
        f->bounds = malloc((n_bounds ? n_bounds : 1) * sizeof *f->bounds);
        if (!f->bounds) goto nomem;
        memcpy(f->bounds, bounds, n_bounds * sizeof *bounds);
        f->n_bounds = n_bounds;
    }
    *out = f;
    return KVB_OK;
nomem:
    family_free(f);
    return kvb_err_set(err, KVB_ERR_NOMEM, "metrics: out of memory");
}

kvb_status kvb_metrics_register(kvb_metrics *m, kvb_metric_type type, const char *name,
                                const char *help, const char *label_names, const double *bounds,
                                size_t n_bounds, kvb_metric **out, kvb_err *err) {
    *out = NULL;
    if (!m) return kvb_err_set(err, KVB_ERR_INVALID, "metrics: no registry");
    if (type != KVB_METRIC_COUNTER && type != KVB_METRIC_GAUGE && type != KVB_METRIC_HISTOGRAM)
        return kvb_err_set(err, KVB_ERR_INVALID, "metrics: unknown metric type %d", (int)type);
    if (!valid_metric_name(name))
        return kvb_err_set(err, KVB_ERR_INVALID, "metrics: invalid metric name '%s'", name ? name : "(null)");
    if (!label_names) label_names = "";
    if (type == KVB_METRIC_HISTOGRAM) {
        if (!bounds) {
            bounds = default_latency_bounds;
            n_bounds = KVB_ARRAY_LEN(default_latency_bounds);
        }
        for (size_t i = 0; i < n_bounds; i++) {
            if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
                return kvb_err_set(err, KVB_ERR_INVALID, "metrics: %s: histogram bounds must be "
                                   "finite and strictly increasing (bound %zu)", name, i);
        }
    } else {
        bounds = NULL;
        n_bounds = 0;
    }
    pthread_mutex_lock(&m->mu);
    kvb_status st = KVB_OK;
    for (size_t i = 0; i < m->n_families; i++) {
        kvb_metric *f = m->families[i];
        if (strcmp(f->name, name) != 0) continue;
        if (same_family(f, type, label_names, bounds, n_bounds)) *out = f;
        else st = kvb_err_set(err, KVB_ERR_INVALID, "metrics: '%s' is already registered with a "
                              "different type, labels or buckets", name);
        pthread_mutex_unlock(&m->mu);
        return st;
    }
    if (m->n_families == m->cap_families) {
        size_t cap = m->cap_families ? m->cap_families * 2 : 16;
        kvb_metric **grown = realloc(m->families, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&m->mu);
            return kvb_err_set(err, KVB_ERR_NOMEM, "metrics: out of memory");
        }
        m->families = grown;
        m->cap_families = cap;
    }
    kvb_metric *f = NULL;
    st = family_new(type, name, help, label_names, bounds, n_bounds, &f, err);
    if (st == KVB_OK) {
        f->registry = m;
        m->families[m->n_families++] = f;
        *out = f;
    }
    pthread_mutex_unlock(&m->mu);
    return st;
}

/* ---- observations ---------------------------------------------------------------------------- */

static uint64_t labels_hash(const kvb_metric *f, const char *const *values) {
    uint64_t h = 0x6b76622d6d657472ULL;
    for (size_t i = 0; i < f->n_labels; i++) {
        const char *v = (values && values[i]) ? values[i] : "";
        h = kvb_hash64(v, strlen(v), h + i);
    }
    return h;
}

/* The series for the label values (created when absent); NULL when the family is full or memory
 * ran out. Called with the registry mutex held. */
static metric_series *series_get(kvb_metric *f, const char *const *values, bool create) {
    uint64_t h = labels_hash(f, values);
    for (size_t i = 0; i < f->n_series; i++) {
        metric_series *s = &f->series[i];
        if (s->hash != h) continue;
        bool same = true;
        for (size_t j = 0; j < f->n_labels && same; j++)
            same = strcmp(s->values[j], (values && values[j]) ? values[j] : "") == 0;
        if (same) return s;
    }
    if (!create) return NULL;
    if (f->n_series >= KVB_METRIC_MAX_SERIES) {
        if (!f->warned_full) {
            kvb_log(KVB_LOG_WARN, "metrics: %s has %d series; dropping new label values", f->name,
                    KVB_METRIC_MAX_SERIES);
            f->warned_full = true;
        }
        return NULL;
    }
    if (f->n_series == f->cap_series) {
        size_t cap = f->cap_series ? f->cap_series * 2 : 8;
        metric_series *grown = realloc(f->series, cap * sizeof *grown);
        if (!grown) return NULL;
        f->series = grown;
        f->cap_series = cap;
    }
    metric_series s = {.hash = h};
    s.values = calloc(f->n_labels ? f->n_labels : 1, sizeof *s.values);
    if (!s.values) return NULL;
    for (size_t j = 0; j < f->n_labels; j++) {
        s.values[j] = strdup((values && values[j]) ? values[j] : "");
        if (!s.values[j]) {
            for (size_t k = 0; k < j; k++) free(s.values[k]);
            free(s.values);
            return NULL;
        }
    }
    if (f->type == KVB_METRIC_HISTOGRAM) {
        s.buckets = calloc(f->n_bounds + 1, sizeof *s.buckets);
        if (!s.buckets) {
            for (size_t j = 0; j < f->n_labels; j++) free(s.values[j]);
            free(s.values);
            return NULL;
        }
    }
    f->series[f->n_series] = s;
    return &f->series[f->n_series++];
}

void kvb_metric_add(kvb_metric *f, const char *const *label_values, double delta) {
    if (!f || f->type == KVB_METRIC_HISTOGRAM || isnan(delta)) return;
    if (f->type == KVB_METRIC_COUNTER && delta < 0) return;
    pthread_mutex_lock(&f->registry->mu);
    metric_series *s = series_get(f, label_values, true);
    if (s) s->value += delta;
    pthread_mutex_unlock(&f->registry->mu);
}

void kvb_metric_set(kvb_metric *f, const char *const *label_values, double value) {
    if (!f || f->type != KVB_METRIC_GAUGE) return;
    pthread_mutex_lock(&f->registry->mu);
    metric_series *s = series_get(f, label_values, true);
    if (s) s->value = value;
    pthread_mutex_unlock(&f->registry->mu);
}

void kvb_metric_observe(kvb_metric *f, const char *const *label_values, double value) {
    if (!f || f->type != KVB_METRIC_HISTOGRAM || isnan(value)) return;
    pthread_mutex_lock(&f->registry->mu);
    metric_series *s = series_get(f, label_values, true);
    if (s) {
        size_t b = 0;
        while (b < f->n_bounds && value > f->bounds[b]) b++; /* le: value <= bound */
        s->buckets[b]++;
        s->sum += value;
        s->count++;
    }
    pthread_mutex_unlock(&f->registry->mu);
}

double kvb_metric_value(kvb_metric *f, const char *const *label_values) {
    if (!f) return 0;
    pthread_mutex_lock(&f->registry->mu);
    metric_series *s = series_get(f, label_values, false);
    double v = !s ? 0 : f->type == KVB_METRIC_HISTOGRAM ? (double)s->count : s->value;
    pthread_mutex_unlock(&f->registry->mu);
    return v;
}

/* ---- rendering ------------------------------------------------------------------------------- */

/* Shortest text that reads back as the same double (Go's ParseFloat accepts all of these). */
static void format_value(char *buf, size_t cap, double v) {
    if (isnan(v)) { snprintf(buf, cap, "NaN"); return; }
    if (isinf(v)) { snprintf(buf, cap, v > 0 ? "+Inf" : "-Inf"); return; }
    if (v == floor(v) && fabs(v) < 1e15) { snprintf(buf, cap, "%.0f", v); return; }
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

static void append_escaped(http_buf *b, const char *s, bool quote_escape) {
    for (const char *p = s; *p; p++) {
        if (*p == '\\') http_buf_append(b, "\\\\", 2);
        else if (*p == '\n') http_buf_append(b, "\\n", 2);
        else if (*p == '"' && quote_escape) http_buf_append(b, "\\\"", 2);
        else http_buf_append(b, p, 1);
    }
}

/* {a="x",b="y"[,le="0.5"]} — nothing when there are no labels and no le. */
static void append_labels(http_buf *b, const kvb_metric *f, const metric_series *s, const char *le) {
    if (f->n_labels == 0 && !le) return;
    http_buf_append(b, "{", 1);
    for (size_t j = 0; j < f->n_labels; j++) {
        if (j) http_buf_append(b, ",", 1);
        http_buf_append_str(b, f->label_names[j]);
        http_buf_append(b, "=\"", 2);
        append_escaped(b, s->values[j], true);
        http_buf_append(b, "\"", 1);
    }
    if (le) {
        if (f->n_labels) http_buf_append(b, ",", 1);
        http_buf_appendf(b, "le=\"%s\"", le);
    }
    http_buf_append(b, "}", 1);
}

static void render_family(http_buf *b, const kvb_metric *f) {
    static const char *type_names[] = {"counter", "gauge", "histogram"};
    http_buf_appendf(b, "# HELP %s ", f->name);
    append_escaped(b, f->help, false);
    http_buf_appendf(b, "\n# TYPE %s %s\n", f->name, type_names[f->type]);
    char num[64], le[64];
    for (size_t i = 0; i < f->n_series; i++) {
        const metric_series *s = &f->series[i];
        if (f->type != KVB_METRIC_HISTOGRAM) {
            http_buf_append_str(b, f->name);
            append_labels(b, f, s, NULL);
            format_value(num, sizeof num, s->value);
            http_buf_appendf(b, " %s\n", num);
            continue;
        }
        uint64_t cumulative = 0;
        for (size_t k = 0; k <= f->n_bounds; k++) {
            cumulative += s->buckets[k];
            if (k < f->n_bounds) format_value(le, sizeof le, f->bounds[k]);
            else snprintf(le, sizeof le, "+Inf");
            http_buf_appendf(b, "%s_bucket", f->name);
            append_labels(b, f, s, le);
            http_buf_appendf(b, " %llu\n", (unsigned long long)cumulative);
        }
        http_buf_appendf(b, "%s_sum", f->name);
        append_labels(b, f, s, NULL);
        format_value(num, sizeof num, s->sum);
        http_buf_appendf(b, " %s\n", num);
        http_buf_appendf(b, "%s_count", f->name);
        append_labels(b, f, s, NULL);
        http_buf_appendf(b, " %llu\n", (unsigned long long)s->count);
    }
}

kvb_status kvb_metrics_render(kvb_metrics *m, char **out, size_t *len, kvb_err *err) {
    *out = NULL;
    if (len) *len = 0;
    if (!m) return kvb_err_set(err, KVB_ERR_INVALID, "metrics: no registry");
    http_buf b = {0};
    http_buf_append(&b, "", 0);
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < m->n_families; i++) render_family(&b, m->families[i]);
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        http_buf_free(&b);
        return kvb_err_set(err, KVB_ERR_NOMEM, "metrics: out of memory rendering");
    }
    *out = b.data;
    if (len) *len = b.len;
    return KVB_OK;
}
