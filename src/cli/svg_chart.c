/* cli/svg_chart.c — time to first token by prompt length as a standalone SVG (no script, no
 * external font or style): log-scaled axes (prompt lengths span 1K..1M tokens and times 10 ms..
 * minutes; lengths that span less than 8x, as a conversation's turns do, on a linear axis), ticks labelled
 * at the measured lengths and at 1-2-5 steps of seconds, one coloured
 * line with points per series, a legend, the title and a note. Every number and label in the
 * document comes from the caller's data; text is XML-escaped. */
#include <errno.h>
#include <stdbool.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "svg_chart.h"

enum { W = 760, H = 490, ML = 78, MR = 24, MT = 64, MB = 84 }; /* canvas and plot margins, px */
static const char *const k_colors[KVB_SVG_MAX_SERIES] = {"#c53030", "#2f6fdb", "#1d8a3a", "#b7791f", "#6b46c1",
                                                         "#4a5568"};

static void put_f(kvb_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put_f(kvb_strbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) b->oom = true; /* every call here writes short lines */
    else kvb_strbuf_putn(b, tmp, (size_t)n);
}

/* s as XML character data or an attribute value. */
static void put_text(kvb_strbuf *b, const char *s) {
    for (; s && *s; s++) {
        switch (*s) {
        case '&': kvb_strbuf_put(b, "&amp;"); break;
        case '<': kvb_strbuf_put(b, "&lt;"); break;
        case '>': kvb_strbuf_put(b, "&gt;"); break;
        case '"': kvb_strbuf_put(b, "&quot;"); break;
        case '\'': kvb_strbuf_put(b, "&apos;"); break;
        default:
            if ((unsigned char)*s < 0x20 && *s != '\t' && *s != '\n') kvb_strbuf_put(b, "?"); /* not allowed in XML */
            else kvb_strbuf_putn(b, s, 1);
        }
    }
}

static bool measured(double y) { return isfinite(y) && y > 0; }

/* "1K", "16K", "1M" for lengths that are whole multiples of 1024, else the number. */
static void tokens_label(char *buf, size_t cap, double x) {
    const double k = x / 1024, m = x / 1048576;
    if (x >= 1048576 && m == floor(m)) snprintf(buf, cap, "%.0fM", m);
    else if (x >= 1024 && k == floor(k)) snprintf(buf, cap, "%.0fK", k);
    else snprintf(buf, cap, "%.0f", x);
}

static void seconds_label(char *buf, size_t cap, double y) {
    if (y >= 1) snprintf(buf, cap, "%.0f s", y);
    else if (y >= 0.001) snprintf(buf, cap, "%.0f ms", y * 1000);
    else snprintf(buf, cap, "%.0f µs", y * 1e6);
}

typedef struct {
    bool xlog;             /* lengths spanning 8x or more: a log axis; else linear */
    double x0, x1, y0, y1; /* the axes' ends (log10 of them on a log axis; y always is) */
} axes;

static double px_x(const axes *a, double x) {
    const double v = a->xlog ? log10(x) : x;
    return ML + (v - a->x0) / (a->x1 - a->x0) * (W - ML - MR);
}
static double px_y(const axes *a, double y) { return H - MB - (log10(y) - a->y0) / (a->y1 - a->y0) * (H - MT - MB); }

/* The axes' ranges from the data; KVB_ERR_INVALID when there is nothing to draw. */
static kvb_status chart_axes(const kvb_svg_chart *c, axes *a, kvb_err *err) {
    if (!c->n || !c->x || !c->n_series || c->n_series > KVB_SVG_MAX_SERIES || !c->series)
        return kvb_err_set(err, KVB_ERR_INVALID, "svg chart: %zu lengths and %zu series (1..%d)", c->n, c->n_series,
                           KVB_SVG_MAX_SERIES);
    double xmin = INFINITY, xmax = 0, ymin = INFINITY, ymax = 0;
    for (size_t i = 0; i < c->n; i++) {
        if (!isfinite(c->x[i]) || c->x[i] <= 0)
            return kvb_err_set(err, KVB_ERR_INVALID, "svg chart: prompt length %g is not positive", c->x[i]);
        xmin = fmin(xmin, c->x[i]);
        xmax = fmax(xmax, c->x[i]);
        for (size_t s = 0; s < c->n_series; s++) {
            const double y = c->series[s].y ? c->series[s].y[i] : NAN;
            if (measured(y)) ymin = fmin(ymin, y), ymax = fmax(ymax, y);
        }
    }
    if (!(ymax > 0)) return kvb_err_set(err, KVB_ERR_INVALID, "svg chart: no measured point");
    a->xlog = xmax >= 8 * xmin;
    if (a->xlog) {
        a->x0 = log10(xmin) - 0.15;
        a->x1 = log10(xmax) + 0.15;
    } else { /* a few turns of one conversation: close lengths, apart on a linear axis */
        const double pad = 0.08 * fmax(xmax - xmin, 0.1 * xmax);
        a->x0 = fmax(0, xmin - pad);
        a->x1 = xmax + pad;
    }
    a->y0 = floor(log10(ymin));
    a->y1 = ceil(log10(ymax));
    if (a->y1 - a->y0 < 1) a->y1 = a->y0 + 1;
    return KVB_OK;
}

/* The frame, the ticks (x at every measured length, y at 1-2-5 steps) and the axis labels. */
static void chart_frame(const kvb_svg_chart *c, const axes *a, kvb_strbuf *b) {
    char lab[32];
    put_f(b, "<rect class=\"plot\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#999\"/>\n", ML,
          MT, W - ML - MR, H - MT - MB);
    for (int e = (int)a->y0; e <= (int)a->y1; e++) {
        for (int m = 1; m <= 5; m += (m == 1 ? 1 : 3)) { /* 1, 2, 5 */
            const double y = m * pow(10, e);
            if (log10(y) > a->y1 + 1e-9) break;
            const double py = px_y(a, y);
            put_f(b, "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#e2e2e2\"/>\n", ML, W - MR, py, py);
            seconds_label(lab, sizeof lab, y);
            put_f(b, "<text class=\"tick\" x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", ML - 6, py + 4, lab);
        }
    }
    double last_px = -1e9; /* a length's label too close to the one before is left out (its line stays) */
    for (size_t i = 0; i < c->n; i++) {
        const double px = px_x(a, c->x[i]);
        tokens_label(lab, sizeof lab, c->x[i]);
        put_f(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" stroke=\"#e2e2e2\"/>\n", px, px, MT, H - MB);
        if (fabs(px - last_px) < 9.0 * (double)strlen(lab)) continue;
        put_f(b, "<text class=\"tick\" x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n", px, H - MB + 18, lab);
        last_px = px;
    }
    kvb_strbuf_put(b, "<text class=\"axis\" x=\"");
    put_f(b, "%d\" y=\"%d\" text-anchor=\"middle\">", ML + (W - ML - MR) / 2, H - 42);
    put_text(b, c->x_label);
    put_f(b, "</text>\n<text class=\"axis\" transform=\"translate(18 %d) rotate(-90)\" text-anchor=\"middle\">",
          MT + (H - MT - MB) / 2);
    put_text(b, c->y_label);
    kvb_strbuf_put(b, "</text>\n<text class=\"title\" x=\"16\" y=\"28\">");
    put_text(b, c->title);
    kvb_strbuf_put(b, "</text>\n");
    if (c->note) {
        kvb_strbuf_put(b, "<text class=\"note\" x=\"16\" y=\"48\">");
        put_text(b, c->note);
        kvb_strbuf_put(b, "</text>\n");
    }
}

/* One series: its line through the measured points, the points, its legend entry. */
static void chart_series(const kvb_svg_chart *c, const axes *a, size_t s, kvb_strbuf *b) {
    const kvb_svg_series *sr = &c->series[s];
    const char *color = k_colors[s];
    put_f(b, "<g class=\"series\" stroke=\"%s\" fill=\"%s\">\n<polyline fill=\"none\" stroke-width=\"2\" points=\"",
          color, color);
    for (size_t i = 0; i < c->n; i++)
        if (sr->y && measured(sr->y[i])) put_f(b, "%.1f,%.1f ", px_x(a, c->x[i]), px_y(a, sr->y[i]));
    kvb_strbuf_put(b, "\"/>\n");
    for (size_t i = 0; i < c->n; i++) {
        if (!sr->y || !measured(sr->y[i])) continue;
        kvb_strbuf_put(b, "<circle class=\"point\" data-series=\"");
        put_text(b, sr->name);
        put_f(b, "\" data-x=\"%.17g\" data-y=\"%.17g\" cx=\"%.1f\" cy=\"%.1f\" r=\"4\"><title>", c->x[i], sr->y[i],
              px_x(a, c->x[i]), px_y(a, sr->y[i]));
        put_text(b, sr->name);
        put_f(b, ": %.0f tokens, %.4g s</title></circle>\n", c->x[i], sr->y[i]);
    }
    const int lx = ML + 200 * (int)s, ly = H - 12; /* the legend: a row under the axis label */
    put_f(b, "<line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke-width=\"2\"/>\n", lx, lx + 24, ly - 4, ly - 4);
    put_f(b, "<text class=\"legend\" x=\"%d\" y=\"%d\" stroke=\"none\" fill=\"#222\">", lx + 30, ly);
    put_text(b, sr->name);
    kvb_strbuf_put(b, "</text>\n</g>\n");
}

kvb_status kvb_svg_chart_render(const kvb_svg_chart *c, kvb_strbuf *out, kvb_err *err) {
    axes a = {.xlog = true, .x0 = 0, .x1 = 1, .y0 = 0, .y1 = 1};
    kvb_status st = chart_axes(c, &a, err);
    if (st) return st;
    put_f(out, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
               "height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n",
          W, H, W, H);
    kvb_strbuf_put(out, "<style>.title{font-size:17px;font-weight:bold}.note{fill:#555}.axis{font-size:13px}"
                        ".tick{fill:#444}</style>\n<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n");
    chart_frame(c, &a, out);
    for (size_t s = 0; s < c->n_series; s++) chart_series(c, &a, s, out);
    kvb_strbuf_put(out, "</svg>\n");
    return out->oom ? kvb_err_set(err, KVB_ERR_NOMEM, "svg chart: out of memory") : KVB_OK;
}

kvb_status kvb_svg_chart_write(const kvb_svg_chart *c, const char *path, kvb_err *err) {
    kvb_strbuf b = {0};
    kvb_status st = kvb_svg_chart_render(c, &b, err);
    if (st) {
        free(b.p);
        return st;
    }
    FILE *f = fopen(path, "wb");
    const bool ok = f && fwrite(b.p, 1, b.n, f) == b.n;
    const int e = errno;
    if (f && fclose(f) != 0 && ok) st = kvb_err_set(err, KVB_ERR_IO, "svg chart: %s: %s", path, strerror(errno));
    else if (!ok) st = kvb_err_set(err, KVB_ERR_IO, "svg chart: %s: %s", path, strerror(e));
    free(b.p);
    return st;
}
