/* core/status.c — error values with messages: library code reports, the CLI decides. */
#include "kvb_core.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

kvb_status kvb_err_set(kvb_err *err, kvb_status code, const char *fmt, ...) {
    if (err) {
        err->code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

kvb_status kvb_err_prefix(kvb_err *err, const char *fmt, ...) {
    if (!err) return KVB_ERR_INTERNAL;
    char prefix[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    char old[sizeof err->msg];
    memcpy(old, err->msg, sizeof old);
    size_t np = strlen(prefix);
    if (np >= sizeof err->msg) np = sizeof err->msg - 1;
    memcpy(err->msg, prefix, np);
    size_t room = sizeof err->msg - 1 - np, no = strnlen(old, sizeof old);
    if (no > room) no = room;
    memcpy(err->msg + np, old, no);
    err->msg[np + no] = 0;
    return err->code;
}

const char *kvb_status_name(kvb_status s) {
    switch (s) {
    case KVB_OK: return "ok";
    case KVB_ERR_IO: return "io error";
    case KVB_ERR_FORMAT: return "malformed input";
    case KVB_ERR_INVALID: return "invalid argument";
    case KVB_ERR_UNSUPPORTED: return "unsupported";
    case KVB_ERR_NOMEM: return "out of memory";
    case KVB_ERR_RANGE: return "out of range";
    case KVB_ERR_NOT_FOUND: return "not found";
    case KVB_ERR_INTERNAL: return "internal error";
    case KVB_ERR_TIMEOUT: return "timed out";
    case KVB_ERR_CANCELLED: return "cancelled";
    case KVB_ERR_CHECKSUM: return "checksum mismatch";
    case KVB_ERR_AUTH: return "authentication failed";
    case KVB_ERR_PEER_GONE: return "peer gone";
    case KVB_ERR_MISMATCH: return "peers do not match";
    case KVB_ERR_REFUSED: return "refused by the peer";
    }
    return "unknown status";
}
