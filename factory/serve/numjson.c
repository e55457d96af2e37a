/* The number lists of posted ScoredData bodies read without Python objects.
 *
 * nj_read_body reads a whole body in one pass: the number-list fields (tokens, masks, advantages,
 * ref_logprobs, inference_logprobs) are read where they are found, and the rest of the body is copied out
 * for the general JSON decoder, which then has only a few KB left to decode (it would otherwise scan every
 * number a second time just to skip it).
 *
 * Called through ctypes, which releases the GIL for the call, so posts decode beside the event loop.
 * Integers are parsed here into int32. Other numbers are only checked against JSON's number grammar and
 * copied, packed, into a character buffer with offsets (an Arrow string array's layout): Arrow's cast to
 * float64 then parses them, correctly rounded and also without the GIL.
 *
 * Only plain numbers are accepted; anything else (strings, nulls, deeper nesting, an integer outside int32,
 * an exponent beyond +-290, an escaped or repeated field name) returns NJ_ERROR, and the caller takes its
 * general path, which gives the user-facing answer. So this file only has to be right about what it
 * accepts, never about what it refuses.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define NJ_ERROR (-1)
#define NJ_FULL (-2)

static const char *skip_space(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

static inline int is_digit(const char *p, const char *end) { return p < end && (unsigned char)(*p - '0') < 10; }

/* The end of a JSON number starting at p, or NULL if none starts there (or its exponent is beyond +-290);
 * *is_integer says it has no fraction and no exponent. */
static inline const char *number_end(const char *p, const char *end, int *is_integer) {
    if (p < end && *p == '-') p++;
    if (p < end && *p == '0') {
        p++;
    } else if (p < end && *p >= '1' && *p <= '9') {
        while (is_digit(p, end)) p++;
    } else {
        return NULL;
    }
    *is_integer = 1;
    if (p < end && *p == '.') {
        p++;
        if (!is_digit(p, end)) return NULL;
        while (is_digit(p, end)) p++;
        *is_integer = 0;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (!is_digit(p, end)) return NULL;
        int exponent = 0;
        for (; is_digit(p, end); p++) {
            exponent = exponent * 10 + (*p - '0');
            if (exponent > 290) return NULL;
        }
        *is_integer = 0;
    }
    return p;
}

/* number_end that also copies the number's text to `to` as it reads it (a memcpy call per number cost more). */
static inline const char *copy_number(const char *p, const char *end, char *to) {
    if (p < end && *p == '-') *to++ = *p++;
    if (p < end && *p == '0') {
        *to++ = *p++;
    } else if (p < end && *p >= '1' && *p <= '9') {
        while (is_digit(p, end)) *to++ = *p++;
    } else {
        return NULL;
    }
    if (p < end && *p == '.') {
        *to++ = *p++;
        if (!is_digit(p, end)) return NULL;
        while (is_digit(p, end)) *to++ = *p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        *to++ = *p++;
        if (p < end && (*p == '+' || *p == '-')) *to++ = *p++;
        if (!is_digit(p, end)) return NULL;
        int exponent = 0;
        for (; is_digit(p, end); p++) {
            exponent = exponent * 10 + (*p - '0');
            if (exponent > 290) return NULL;
            *to++ = *p;
        }
    }
    return p;
}

/* The end of the JSON integer at p, read into *out, or NULL if no integer starts there, it has a fraction or an
 * exponent, or it is outside int32 (one pass: number_end and a second scan cost a third more). */
static inline const char *read_int32(const char *p, const char *end, int32_t *out) {
    int negative = p < end && *p == '-';
    if (negative) p++;
    const char *digits = p;
    int64_t value = 0;
    if (p < end && *p == '0') {
        p++;
    } else {
        for (; p < end && (unsigned char)(*p - '0') < 10; p++) {
            if (p - digits == 10) return NULL;
            value = value * 10 + (*p - '0');
        }
    }
    if (p == digits || (p < end && (*p == '.' || *p == 'e' || *p == 'E'))) return NULL;
    if (negative) value = -value;
    if (value < INT32_MIN || value > INT32_MAX) return NULL;
    *out = (int32_t)value;
    return p;
}

/* Output buffers of a read: integers go to `values`; other numbers' texts to `chars`, number i (counted over
 * the whole read) being chars[offsets[i]:offsets[i + 1]]; the length of every inner array to `lengths`. */
typedef struct {
    int32_t *values;
    char *chars;
    int32_t *offsets;
    size_t value_capacity, length_capacity;
    int32_t *lengths;
    size_t values_used, chars_used, floats_used, lengths_used;
    long status;
} nj_out;

/* Reads the JSON array of arrays of numbers at p (after any space) into `out` and returns the end of it, or
 * NULL with out->status NJ_ERROR (not such an array, or a number that does not fit) or NJ_FULL. */
static const char *read_array_2d(const char *p, const char *end, int integers, nj_out *out) {
    size_t count = integers ? out->values_used : out->floats_used;
    size_t rows = out->lengths_used, used = out->chars_used;
    out->status = NJ_ERROR;
    p = skip_space(p, end);
    if (p >= end || *p != '[') return NULL;
    p = skip_space(p + 1, end);
    if (p < end && *p == ']') {
        p++;
    } else {
        for (;;) {
            if (p >= end || *p != '[') return NULL;
            if (rows == out->length_capacity) { out->status = NJ_FULL; return NULL; }
            size_t row_start = count;
            p = skip_space(p + 1, end);
            if (p < end && *p == ']') {
                p++;
            } else {
                for (;;) {
                    if (count == out->value_capacity) { out->status = NJ_FULL; return NULL; }
                    const char *stop;
                    if (integers) {
                        stop = read_int32(p, end, out->values + count);
                        if (stop == NULL) return NULL;
                    } else {
                        stop = copy_number(p, end, out->chars + used); /* fits: the numbers' texts are within text */
                        if (stop == NULL) return NULL;
                        used += (size_t)(stop - p);
                        if (stop - p == 2 && p[0] == '-' && p[1] == '0') { /* "-0" reads as 0, as msgspec has it */
                            used--;
                            out->chars[used - 1] = '0';
                        }
                        if (used > INT32_MAX) return NULL;
                        out->offsets[count + 1] = (int32_t)used;
                    }
                    count++;
                    p = skip_space(stop, end);
                    if (p < end && *p == ',') {
                        p = skip_space(p + 1, end);
                        continue;
                    }
                    if (p < end && *p == ']') {
                        p++;
                        break;
                    }
                    return NULL;
                }
            }
            if (count - row_start > INT32_MAX) return NULL;
            out->lengths[rows++] = (int32_t)(count - row_start);
            p = skip_space(p, end);
            if (p < end && *p == ',') {
                p = skip_space(p + 1, end);
                continue;
            }
            if (p < end && *p == ']') {
                p++;
                break;
            }
            return NULL;
        }
    }
    if (integers) out->values_used = count; else out->floats_used = count;
    out->lengths_used = rows;
    out->chars_used = used;
    out->status = 0;
    return p;
}

/* ---- whole bodies: the number-list fields of ScoredData objects, read in the same pass that finds them ---- */

#define NJ_FIELDS 5
static const char *const FIELD_NAMES[NJ_FIELDS] = {"tokens", "masks", "advantages", "ref_logprobs", "inference_logprobs"};
static const int FIELD_INTEGERS[NJ_FIELDS] = {1, 1, 0, 0, 0};
#define NJ_MAX_DEPTH 64

static const char *skip_string(const char *p, const char *end) { /* p at '"'; the end of the string */
    for (p++; p < end; p++) {
        if (*p == '"') return p + 1;
        if (*p == '\\') p++;
    }
    return NULL;
}

/* The end of the JSON value at p (checked only as far as its structure: strings' contents are left to the
 * caller's JSON decoder), or NULL. */
static const char *skip_value(const char *p, const char *end, int depth) {
    p = skip_space(p, end);
    if (p >= end || depth > NJ_MAX_DEPTH) return NULL;
    if (*p == '"') return skip_string(p, end);
    if (*p == '{' || *p == '[') {
        char close = *p == '{' ? '}' : ']';
        int object = *p == '{';
        p = skip_space(p + 1, end);
        if (p < end && *p == close) return p + 1;
        for (;;) {
            if (object) {
                if (p >= end || *p != '"') return NULL;
                p = skip_string(p, end);
                if (p == NULL) return NULL;
                p = skip_space(p, end);
                if (p >= end || *p != ':') return NULL;
                p++;
            }
            p = skip_value(p, end, depth + 1);
            if (p == NULL) return NULL;
            p = skip_space(p, end);
            if (p < end && *p == ',') { p = skip_space(p + 1, end); continue; }
            if (p < end && *p == close) return p + 1;
            return NULL;
        }
    }
    if (*p == 't') return end - p >= 4 && memcmp(p, "true", 4) == 0 ? p + 4 : NULL;
    if (*p == 'f') return end - p >= 5 && memcmp(p, "false", 5) == 0 ? p + 5 : NULL;
    if (*p == 'n') return end - p >= 4 && memcmp(p, "null", 4) == 0 ? p + 4 : NULL;
    int is_integer;
    return number_end(p, end, &is_integer);
}

/* One ScoredData object at p: its number-list fields are read into `out` (a record of group, field, inner
 * arrays and numbers each, in `records`) and copied to `stripped` as [], everything else copied as is. */
static const char *read_group(const char *p, const char *end, long group, nj_out *out, char **stripped,
                              const char **copied, int32_t *records, size_t record_capacity, size_t *record_count) {
    int seen = 0;
    p = skip_space(p, end);
    if (p >= end || *p != '{') return NULL;
    p = skip_space(p + 1, end);
    if (p < end && *p == '}') return p + 1;
    for (;;) {
        if (p >= end || *p != '"') return NULL;
        const char *key = p + 1;
        p = skip_string(p, end);
        if (p == NULL) return NULL;
        size_t key_size = (size_t)(p - 1 - key);
        if (memchr(key, '\\', key_size) != NULL) return NULL; /* an escaped key: the general path decides */
        p = skip_space(p, end);
        if (p >= end || *p != ':') return NULL;
        p = skip_space(p + 1, end);
        int field = -1;
        for (int f = 0; f < NJ_FIELDS; f++) {
            if (strlen(FIELD_NAMES[f]) == key_size && memcmp(FIELD_NAMES[f], key, key_size) == 0) field = f;
        }
        if (field >= 0 && (seen & (1 << field))) return NULL; /* a repeated field: the general path decides */
        if (field >= 0) seen |= 1 << field;
        if (field >= 0 && p < end && *p == '[') {
            size_t rows = out->lengths_used;
            size_t values = FIELD_INTEGERS[field] ? out->values_used : out->floats_used;
            const char *stop = read_array_2d(p, end, FIELD_INTEGERS[field], out);
            if (stop == NULL) return NULL;
            if (*record_count == record_capacity) { out->status = NJ_FULL; return NULL; }
            int32_t *record = records + 4 * *record_count;
            record[0] = (int32_t)group;
            record[1] = field;
            record[2] = (int32_t)(out->lengths_used - rows);
            record[3] = (int32_t)((FIELD_INTEGERS[field] ? out->values_used : out->floats_used) - values);
            ++*record_count;
            memcpy(*stripped, *copied, (size_t)(p - *copied));
            *stripped += p - *copied;
            memcpy(*stripped, "[]", 2);
            *stripped += 2;
            *copied = stop;
            p = stop;
        } else {
            p = skip_value(p, end, 1);
            if (p == NULL) return NULL;
        }
        p = skip_space(p, end);
        if (p < end && *p == ',') { p = skip_space(p + 1, end); continue; }
        if (p < end && *p == '}') return p + 1;
        return NULL;
    }
}

/* Reads a /scored_data body (one object; `many`: a list of them) in one pass: every number-list field that is
 * an array of arrays of plain numbers goes to the buffers (as read_array_2d reads them, over all fields in body
 * order) with a record of 4 int32 (group, field index in FIELD_NAMES, inner arrays, numbers), and the body
 * is copied to `stripped` with those fields' values as []: what is left for a general JSON decoder is small.
 * Returns the number of objects, NJ_ERROR (anything the general path must decide) or NJ_FULL. */
long nj_read_body(const char *text, size_t size, int many, char *stripped, size_t *stripped_size,
                  int32_t *values, char *chars, int32_t *offsets, size_t value_capacity, int32_t *lengths,
                  size_t length_capacity, int32_t *records, size_t record_capacity, size_t *counts) {
    nj_out out = {values, chars, offsets, value_capacity, length_capacity, lengths, 0, 0, 0, 0, 0};
    const char *p = text, *end = text + size, *copied = text;
    char *write = stripped;
    size_t record_count = 0;
    long groups = 0;
    offsets[0] = 0;
    p = skip_space(p, end);
    if (many) {
        if (p >= end || *p != '[') return NJ_ERROR;
        p = skip_space(p + 1, end);
        if (p < end && *p == ']') {
            p++;
        } else {
            for (;;) {
                p = read_group(p, end, groups++, &out, &write, &copied, records, record_capacity, &record_count);
                if (p == NULL) return out.status == NJ_FULL ? NJ_FULL : NJ_ERROR;
                p = skip_space(p, end);
                if (p < end && *p == ',') { p = skip_space(p + 1, end); continue; }
                if (p < end && *p == ']') { p++; break; }
                return NJ_ERROR;
            }
        }
    } else {
        p = read_group(p, end, groups++, &out, &write, &copied, records, record_capacity, &record_count);
        if (p == NULL) return out.status == NJ_FULL ? NJ_FULL : NJ_ERROR;
    }
    if (skip_space(p, end) != end) return NJ_ERROR;
    memcpy(write, copied, (size_t)(end - copied));
    write += end - copied;
    *stripped_size = (size_t)(write - stripped);
    counts[0] = out.values_used;
    counts[1] = out.floats_used;
    counts[2] = out.lengths_used;
    counts[3] = record_count;
    return groups;
}
