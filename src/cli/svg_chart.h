/* cli/svg_chart.h — a chart of time to first token by prompt length as a standalone SVG file
 * (svg_chart.c): what `kvbridge bench ladder --svg` and `kvbridge demo --svg` write. */
#ifndef KVB_SVG_CHART_H
#define KVB_SVG_CHART_H

#include <stddef.h>

#include "kvb_core.h"

#define KVB_SVG_MAX_SERIES 6

typedef struct {
    const char *name; /* the legend's label, e.g. "bridged" */
    const double *y;  /* (n) seconds at each x; NaN, infinite or <= 0: not measured (no point) */
} kvb_svg_series;

typedef struct {
    const char *title;   /* the heading */
    const char *note;    /* a line under it (the machine, the model), or NULL */
    const char *x_label; /* e.g. "prompt tokens" */
    const char *y_label; /* e.g. "time to first token (s)" */
    const double *x;     /* (n) prompt lengths, each > 0 (a log axis) */
    size_t n;
    const kvb_svg_series *series; /* (n_series), 1..KVB_SVG_MAX_SERIES */
    size_t n_series;
} kvb_svg_chart;

/* The chart as an SVG document appended to out: log-scaled axes with labelled ticks, a line and a
 * point per series (each point a <circle class="point"> with data-series, data-x and data-y, and
 * a <title> for a tooltip), a legend. Labels are XML-escaped. KVB_ERR_INVALID (nothing useful in
 * out) for no points, an x that is not positive and finite, or too many series; KVB_ERR_NOMEM. */
kvb_status kvb_svg_chart_render(const kvb_svg_chart *c, kvb_strbuf *out, kvb_err *err);
/* The same into the file at path (replaced). */
kvb_status kvb_svg_chart_write(const kvb_svg_chart *c, const char *path, kvb_err *err);

#endif
