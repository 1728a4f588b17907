/* web.c — the chat page's files as the server finds them: web/'s files are compiled into the
 * binary by web/embed.cmake (a generated table of byte arrays, no runtime files), "/" is
 * index.html and "/NAME" any other file of web/ (names only: no directories, so no path can
 * climb out), each served with the Content-Type its extension names. */
#include <string.h>

#include "http_internal.h"

const http_web_asset *http_web_find(const char *url) {
    if (!url || url[0] != '/') return NULL;
    const char *name = url[1] ? url + 1 : "index.html";
    if (strchr(name, '/')) return NULL;
    for (size_t i = 0; i < http_web_n_assets; i++)
        if (strcmp(http_web_assets[i].name, name) == 0) return &http_web_assets[i];
    return NULL;
}

const char *http_web_content_type(const char *name) {
    static const struct {
        const char *ext, *type;
    } types[] = {
        {".html", "text/html; charset=utf-8"},
        {".js", "text/javascript; charset=utf-8"},
        {".css", "text/css; charset=utf-8"},
        {".svg", "image/svg+xml"},
    };
    const size_t n = strlen(name);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const size_t k = strlen(types[i].ext);
        if (n > k && strcmp(name + n - k, types[i].ext) == 0) return types[i].type;
    }
    return "application/octet-stream";
}
