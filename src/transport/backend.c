/* transport/backend.c — choosing a wire backend by name ("tcp", "ucx": the --transport option),
 * what carries a connection (kvb_conn_describe), and the UCX answers a build without UCX gives. */
#include <stdio.h>
#include <string.h>

#include "transport_internal.h"

bool kvb_wire_have_ucx(void) {
#ifdef KVB_HAVE_UCX
    return true;
#else
    return false;
#endif
}

kvb_status kvb_wire_backend_by_name(const char *name, const kvb_wire_backend **out, kvb_err *err) {
    if (!name || !*name || !strcmp(name, "tcp")) {
        *out = &kvb_wire_backend_tcp;
        return KVB_OK;
    }
    if (!strcmp(name, "ucx")) {
#ifdef KVB_HAVE_UCX
        *out = &kvb_wire_backend_ucx;
        return KVB_OK;
#else
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "--transport ucx: this build has no UCX (libucx-dev was not found when it was configured; "
                           "install it with tools/install.sh and rebuild)");
#endif
    }
    return kvb_err_set(err, KVB_ERR_INVALID, "--transport \"%s\": expected tcp or ucx", name);
}

#ifndef KVB_HAVE_UCX
void kvb_ucx_last_lanes(char *buf, size_t cap) { snprintf(buf, cap, "not built"); }

kvb_status kvb_conn_ucx_raw_put(kvb_conn *c, const uint8_t *data, size_t piece, uint64_t bytes, int timeout_ms,
                                kvb_err *err) {
    (void)c, (void)data, (void)piece, (void)bytes, (void)timeout_ms;
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "raw put: this build has no UCX");
}
#endif

void kvb_conn_describe(const kvb_conn *c, char *buf, size_t cap) {
    if (c->backend->describe) c->backend->describe(c->link, buf, cap);
    else snprintf(buf, cap, "%s", c->backend->name);
}
