/* cli/quality_prompts.c — deterministic long-context prompts for a quality benchmark
 * ("needle in a haystack"): a readable English document generated from word lists and sentence
 * templates — a company's annual report, a travel journal, or facts about fictional cities — of
 * about the requested size, with one needle sentence ("The secret code of the blue lighthouse is
 * 48217.") put at a depth chosen from the seed, plus the question that asks for it and the answer.
 *
 * Determinism: everything comes from kvb_rng (xoshiro256**, same on every platform) seeded with the
 * seed, integer arithmetic only, fixed word lists: the same (seed, size) gives the same bytes on
 * every machine and build. Size: about 4 characters per token, so the text is target * 4 bytes
 * give or take half a sentence (within 20 % from about 100 tokens up). Guarantees checked here
 * (the document is redrawn otherwise): the needle sentence occurs exactly once, the filler never
 * says "secret code", and the answer's digits occur exactly once in the whole text. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_core.h"

#define CHARS_PER_TOKEN 4u

/* ---- a growable string ------------------------------------------------------------------------ */

typedef kvb_strbuf qbuf;
static void q_putn(qbuf *b, const char *s, size_t n) { kvb_strbuf_putn(b, s, n); }
static void q_put(qbuf *b, const char *s) { kvb_strbuf_put(b, s); }

/* ---- word lists ----------------------------------------------------------------------------- */

static const char *const SYL_A[] = {"Var", "Est", "Quil", "Mor", "Tal", "Bran", "Cor", "Dun", "El", "Fen",
                                    "Gal", "Hal", "Ist", "Kel", "Lorn", "Mar", "Ner", "Ost", "Pell", "Riv",
                                    "Sel", "Thorn", "Ul", "Wen", "Ash", "Brim", "Cald", "Dray"};
static const char *const SYL_B[] = {"a", "e", "i", "o", "en", "ar", "ir", "on", "el", "and", "ow", "ith"};
static const char *const SYL_C[] = {"holm", "port", "ford", "wick", "mere", "stead", "bury", "gate",
                                    "haven", "moor", "dale", "crest", "field", "reach", "vale", "ton"};
static const char *const FIRST[] = {"Ada", "Boris", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo",
                                    "Ines", "Jonas", "Kira", "Luca", "Mira", "Nils", "Olga", "Pavel",
                                    "Rosa", "Soren", "Tamsin", "Viktor", "Wanda", "Yusuf", "Zora", "Emil"};
static const char *const LAST[] = {"Abernethy", "Blackwood", "Castellan", "Drummond", "Ellery", "Fairweather",
                                   "Greaves", "Holloway", "Ingram", "Kestrel", "Lindqvist", "Marchetti",
                                   "Northcott", "Okafor", "Pemberton", "Quaresma", "Rutherford", "Sandoval",
                                   "Thackeray", "Underhill", "Valdez", "Whitlock", "Yarrow", "Zeller"};
static const char *const ADJ[] = {"quiet", "busy", "windswept", "narrow", "ancient", "crowded", "sunny",
                                  "misty", "green", "rocky", "pleasant", "steep", "broad", "sleepy",
                                  "colourful", "famous", "modest", "lively", "remote", "elegant"};
static const char *const INDUSTRY[] = {"fishing", "shipbuilding", "weaving", "farming", "mining", "printing",
                                       "glassmaking", "brewing", "timber", "pottery", "trade", "tourism"};
static const char *const PRODUCT[] = {"smoked fish", "blue wool", "copper kettles", "apple cider", "fine glass",
                                      "sheep cheese", "river pearls", "oak barrels", "maps", "honey cakes",
                                      "salt", "linen", "clocks", "rope"};
static const char *const SEASON[] = {"spring", "summer", "autumn", "winter"};
static const char *const BUILDING[] = {"chapel", "watchtower", "granary", "bridge", "town hall", "mill",
                                       "library", "customs house", "market hall", "fortress"};
static const char *const FEATURE[] = {"harbour", "market square", "gardens", "city walls", "canals",
                                      "rooftops", "bell tower", "stone stairs", "fountains", "old quarter"};
static const char *const WEATHER[] = {"rain", "fog", "bright sunshine", "a cold wind", "light snow",
                                      "a warm breeze", "heavy clouds", "drizzle"};
static const char *const FOOD[] = {"lentil soup", "grilled trout", "fresh bread", "plum dumplings",
                                   "roast chestnuts", "barley stew", "goat cheese", "spiced tea"};
static const char *const TRANSPORT[] = {"on foot", "by ferry", "by mule cart", "by train", "by bicycle",
                                        "on the mail coach", "by river barge"};
static const char *const DEPT[] = {"logistics", "sales", "research", "manufacturing", "customer service",
                                   "finance", "marketing", "engineering"};
static const char *const GOODS[] = {"bicycles", "garden tools", "lamps", "ceramic tiles", "rain jackets",
                                    "kitchen scales", "bookshelves", "water pumps"};
static const char *const QUARTER[] = {"first", "second", "third", "fourth"};
static const char *const TREND[] = {"rose", "fell", "stayed flat", "recovered", "grew steadily", "dipped"};
static const char *const COLOR[] = {"blue", "red", "green", "silver", "golden", "black", "white", "amber",
                                    "violet", "copper", "crimson", "grey"};
static const char *const OBJECT[] = {"lighthouse", "windmill", "bridge", "tower", "gate", "fountain",
                                     "observatory", "clock tower", "boathouse", "lantern", "door", "well"};

#define PICK(r, list) ((list)[kvb_rng_u64(r) % KVB_ARRAY_LEN(list)])

static uint32_t range_u32(kvb_rng *r, uint32_t lo, uint32_t hi) { /* [lo, hi] */
    return lo + (uint32_t)(kvb_rng_u64(r) % ((uint64_t)hi - lo + 1));
}

/* ---- the document's cast: a few cities, people and a company, reused across sentences ---------- */

#define N_CITIES 8
#define N_PEOPLE 6

typedef struct {
    char city[N_CITIES][40];
    char river[3][40];
    char person[N_PEOPLE][48];
    char company[64];
    char region[48];
} cast;

static void make_name(kvb_rng *r, char *out, size_t cap) {
    if (kvb_rng_u64(r) % 3 == 0)
        snprintf(out, cap, "%s%s%s", PICK(r, SYL_A), PICK(r, SYL_B), PICK(r, SYL_C));
    else
        snprintf(out, cap, "%s%s", PICK(r, SYL_A), PICK(r, SYL_C));
}

static void make_cast(kvb_rng *r, cast *c) {
    for (int i = 0; i < N_CITIES; i++) {
        for (int tries = 0; tries < 16; tries++) { /* distinct names */
            make_name(r, c->city[i], sizeof c->city[i]);
            bool dup = false;
            for (int j = 0; j < i; j++) dup |= strcmp(c->city[i], c->city[j]) == 0;
            if (!dup) break;
        }
    }
    for (int i = 0; i < 3; i++) make_name(r, c->river[i], sizeof c->river[i]);
    for (int i = 0; i < N_PEOPLE; i++) snprintf(c->person[i], sizeof c->person[i], "%s %s", PICK(r, FIRST), PICK(r, LAST));
    char base[40];
    make_name(r, base, sizeof base);
    static const char *const KIND[] = {"Shipping", "Instruments", "Textiles", "Foods", "Engineering", "Trading"};
    snprintf(c->company, sizeof c->company, "%s %s", base, PICK(r, KIND));
    make_name(r, c->region, sizeof c->region);
}

/* ---- sentence templates ------------------------------------------------------------------------
 * A template is text with slots: $C / $D a city (two different ones), $R a river, $P a person,
 * $K the company, $G the region, $A adjective, $I industry, $O product, $S season, $B building,
 * $F feature, $W weather, $E food, $T transport, $M department, $U goods, $Q quarter, $V trend,
 * $Y a year, $L a recent year, $N a small number (2-60), $H a population (with thousands separators), $X a money
 * amount in millions ("12.5"), $Z a percentage (1-40), $J a day number. */

static const char *const T_CITIES[] = {
    "$C lies on the $A banks of the $R River, about $N kilometres from the coast.",
    "The population of $C was $H at the last census.",
    "Most people in $C work in $I, and the town is known for its $O.",
    "Every $S, $C holds a festival in honour of its founder, $P.",
    "The oldest building in $C is a $B built in $Y.",
    "Visitors to $C often remark on its $A $F.",
    "The mayor of $C, $P, was elected in $Y and has promised to restore the $B.",
    "$C and $D have been rivals since a dispute over the $R River in $Y.",
    "In $C the streets are $A, and the $F is lit by lanterns at night.",
    "Trade between $C and $D is mostly in $O and $U.",
    "The school in $C teaches $N languages, an unusual number for a town of its size.",
    "A railway line reached $C in $Y, and the journey to $D now takes $N hours.",
    "The climate of $C is mild, although $W is common in $S.",
    "Local cooks in $C are proud of their $E, which is served with $O.",
};
static const char *const T_TRAVEL[] = {
    "On day $J we left $C $T and reached $D before dark.",
    "The road to $D followed the $R River for $N kilometres.",
    "We woke to $W and ate $E at a small inn near the $F.",
    "In $C we met $P, who told us about the $B built in $Y.",
    "The guide in $D showed us the $A $F and the old $B.",
    "That evening the innkeeper served $E and talked about the $I trade.",
    "We spent $N hours in the market of $C, where traders sold $O and $U.",
    "The path over the hills was $A, and $W followed us all afternoon.",
    "On day $J we rested in $C and wrote letters home.",
    "From the top of the $B we could see the $R River and the roofs of $D.",
    "A ferry took us across the $R River; the crossing cost $N coins each.",
    "We bought $O in $C as a gift for friends at home.",
};
static const char *const T_REPORT[] = {
    "$K reported revenue of $X million dollars in the $Q quarter.",
    "Sales of $U $V compared with the previous year, when they made up $Z percent of orders.",
    "The $M department, led by $P, hired $N new employees.",
    "A new warehouse opened in $C in $L to serve customers across $G.",
    "Operating costs $V, mainly because of higher prices for $O.",
    "The board thanked $P for $N years of service as head of $M.",
    "Exports to $D grew by $Z percent, helped by demand for $U.",
    "$K invested $X million dollars in its factory near the $R River.",
    "Customer satisfaction $V in the $Q quarter, according to a survey of $N shops.",
    "The company plans to open an office in $D in $L and expand its range of $U.",
    "Net profit for the year was $X million dollars, $Z percent of revenue.",
    "Staff turnover in $M $V, and training hours per employee reached $N.",
};

typedef struct {
    const char *title_fmt;
    const char *const *t;
    size_t n;
} theme;

static const theme THEMES[] = {
    {"Facts about the cities of %s", T_CITIES, KVB_ARRAY_LEN(T_CITIES)},
    {"A travel journal through %s", T_TRAVEL, KVB_ARRAY_LEN(T_TRAVEL)},
    {"Annual report of %s", T_REPORT, KVB_ARRAY_LEN(T_REPORT)},
};

static void put_thousands(qbuf *b, uint32_t v) {
    char tmp[16];
    int n = snprintf(tmp, sizeof tmp, "%u", v), lead = n % 3 ? n % 3 : 3;
    q_putn(b, tmp, (size_t)lead);
    for (int i = lead; i < n; i += 3) {
        q_put(b, ",");
        q_putn(b, tmp + i, 3);
    }
}

static void expand(kvb_rng *r, const cast *c, const char *t, qbuf *b) {
    int city = (int)(kvb_rng_u64(r) % N_CITIES);
    int other = (city + 1 + (int)(kvb_rng_u64(r) % (N_CITIES - 1))) % N_CITIES;
    char num[32];
    for (const char *p = t; *p; p++) {
        if (*p != '$' || !p[1]) {
            q_putn(b, p, 1);
            continue;
        }
        switch (*++p) {
        case 'C': q_put(b, c->city[city]); break;
        case 'D': q_put(b, c->city[other]); break;
        case 'R': q_put(b, c->river[kvb_rng_u64(r) % 3]); break;
        case 'P': q_put(b, c->person[kvb_rng_u64(r) % N_PEOPLE]); break;
        case 'K': q_put(b, c->company); break;
        case 'G': q_put(b, c->region); break;
        case 'A': q_put(b, PICK(r, ADJ)); break;
        case 'I': q_put(b, PICK(r, INDUSTRY)); break;
        case 'O': q_put(b, PICK(r, PRODUCT)); break;
        case 'S': q_put(b, PICK(r, SEASON)); break;
        case 'B': q_put(b, PICK(r, BUILDING)); break;
        case 'F': q_put(b, PICK(r, FEATURE)); break;
        case 'W': q_put(b, PICK(r, WEATHER)); break;
        case 'E': q_put(b, PICK(r, FOOD)); break;
        case 'T': q_put(b, PICK(r, TRANSPORT)); break;
        case 'M': q_put(b, PICK(r, DEPT)); break;
        case 'U': q_put(b, PICK(r, GOODS)); break;
        case 'Q': q_put(b, PICK(r, QUARTER)); break;
        case 'V': q_put(b, PICK(r, TREND)); break;
        case 'Y': snprintf(num, sizeof num, "%u", range_u32(r, 1120, 1990)); q_put(b, num); break;
        case 'L': snprintf(num, sizeof num, "%u", range_u32(r, 1995, 2024)); q_put(b, num); break;
        case 'N': snprintf(num, sizeof num, "%u", range_u32(r, 2, 60)); q_put(b, num); break;
        case 'J': snprintf(num, sizeof num, "%u", range_u32(r, 1, 90)); q_put(b, num); break;
        case 'Z': snprintf(num, sizeof num, "%u", range_u32(r, 1, 40)); q_put(b, num); break;
        case 'H': put_thousands(b, range_u32(r, 800, 950000)); break;
        case 'X':
            snprintf(num, sizeof num, "%u.%u", range_u32(r, 1, 980), range_u32(r, 0, 9));
            q_put(b, num);
            break;
        default: q_putn(b, p - 1, 2); break;
        }
    }
}

static size_t count_of(const char *hay, const char *needle) {
    size_t n = 0, len = strlen(needle);
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += len) n++;
    return n;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* One attempt: 0 ok, 1 the guarantees failed (the caller redraws), -1 out of memory. */
static int build(kvb_rng *r, uint32_t target_tokens, char **text, char **question, char **answer) {
    cast c;
    make_cast(r, &c);
    const theme *th = &THEMES[kvb_rng_u64(r) % KVB_ARRAY_LEN(THEMES)];
    const char *subject = th->t == T_REPORT ? c.company : c.region;

    /* the needle */
    char needle[160], q[160], code[16];
    const char *color = PICK(r, COLOR), *object = PICK(r, OBJECT);
    snprintf(code, sizeof code, "%u", range_u32(r, 10000, 99999));
    snprintf(needle, sizeof needle, "The secret code of the %s %s is %s.", color, object, code);
    snprintf(q, sizeof q, "What is the secret code of the %s %s?", color, object);

    /* the filler: sentences until the text (with the needle) reaches the target size, the last
     * one kept only if that lands nearer the target */
    uint64_t target = (uint64_t)target_tokens * CHARS_PER_TOKEN;
    size_t budget = target > strlen(needle) + 1 ? (size_t)(target - strlen(needle) - 1) : 0;
    qbuf doc = {0};
    char title[128];
    snprintf(title, sizeof title, th->title_fmt, subject);
    q_put(&doc, title);
    q_put(&doc, "\n\n");
    size_t *ends = NULL, n_sent = 0, cap_sent = 0; /* offset after each sentence (with its separator) */
    uint32_t in_para = 0, para_len = range_u32(r, 3, 6);
    size_t recent[4] = {SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX}; /* no template twice within 5 sentences */
    qbuf s = {0};
    while (!doc.oom && doc.n < budget) {
        s.n = 0;
        if (s.p) s.p[0] = 0;
        size_t ti;
        do ti = (size_t)(kvb_rng_u64(r) % th->n);
        while (ti == recent[0] || ti == recent[1] || ti == recent[2] || ti == recent[3]);
        memmove(recent + 1, recent, 3 * sizeof recent[0]);
        recent[0] = ti;
        expand(r, &c, th->t[ti], &s);
        if (s.oom) break;
        size_t before = doc.n;
        if (n_sent && in_para == 0) q_put(&doc, "\n\n");
        else if (n_sent) q_put(&doc, " ");
        q_put(&doc, s.p);
        if (++in_para == para_len) {
            in_para = 0;
            para_len = range_u32(r, 3, 6);
        }
        if (doc.n >= budget && n_sent && doc.n - budget > budget - before) {
            doc.n = before; /* dropping the last sentence lands nearer the target */
            doc.p[doc.n] = 0;
            break;
        }
        if (n_sent == cap_sent) {
            size_t nc = cap_sent ? cap_sent * 2 : 64;
            size_t *ne = realloc(ends, nc * sizeof *ends);
            if (!ne) {
                doc.oom = true;
                break;
            }
            ends = ne;
            cap_sent = nc;
        }
        ends[n_sent++] = doc.n;
    }
    free(s.p);
    if (doc.oom || s.oom) {
        free(ends);
        free(doc.p);
        return -1;
    }

    /* the depth: after sentence k of n (0 = right after the title) */
    size_t k = (size_t)(kvb_rng_u64(r) % (n_sent + 1));
    size_t at = k ? ends[k - 1] : strlen(title) + 2;
    free(ends);
    qbuf out = {0};
    q_putn(&out, doc.p, at);
    if (k) q_put(&out, " ");
    q_put(&out, needle);
    if (!k && at < doc.n) q_put(&out, " ");
    q_putn(&out, doc.p + at, doc.n - at);
    free(doc.p);
    if (out.oom) {
        free(out.p);
        return -1;
    }
    if (count_of(out.p, needle) != 1 || count_of(out.p, "secret code") != 1 || count_of(out.p, code) != 1) {
        free(out.p);
        return 1;
    }
    char *qq = dup_str(q), *aa = dup_str(code);
    if (!qq || !aa) {
        free(qq);
        free(aa);
        free(out.p);
        return -1;
    }
    *text = out.p;
    *question = qq;
    *answer = aa;
    return 0;
}

int kvb_quality_prompt(uint64_t seed, uint32_t target_tokens_approx, char **text, char **needle_question,
                       char **needle_answer) {
    if (!text || !needle_question || !needle_answer) return -1;
    *text = *needle_question = *needle_answer = NULL;
    if (target_tokens_approx == 0 || target_tokens_approx > (1u << 26)) return -1;
    kvb_rng r;
    kvb_rng_seed(&r, kvb_splitmix64(seed ^ 0x71a11e7u));
    for (int attempt = 0; attempt < 64; attempt++) {
        int rc = build(&r, target_tokens_approx, text, needle_question, needle_answer);
        if (rc <= 0) return rc;
    }
    return -1; /* never seen: 64 draws in a row with the answer's digits in the filler */
}
