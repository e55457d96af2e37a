/* JSON arrays of arrays of numbers ([[1,2],[3]]) read without Python objects.
 *
 * Called through ctypes, which releases the GIL for the call, so posts decode on several cores at once.
 * Integers are parsed here into int32. Other numbers are only checked against JSON's number grammar and
 * copied, packed, into a character buffer with offsets (an Arrow string array's layout): Arrow's cast to
 * float64 then parses them, correctly rounded and also without the GIL.
 *
 * Only plain numbers are accepted; anything else (strings, nulls, deeper nesting, an integer outside int32,
 * an exponent beyond +-290) returns NJ_ERROR, and the caller takes its general path, which gives the
 * user-facing answer. So this file only has to be right about what it accepts, never about what it refuses.
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

static int is_digit(const char *p, const char *end) { return p < end && *p >= '0' && *p <= '9'; }

/* The end of a JSON number starting at p, or NULL if none starts there (or its exponent is beyond +-290);
 * *is_integer says it has no fraction and no exponent. */
static const char *number_end(const char *p, const char *end, int *is_integer) {
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

static int parse_int32(const char *p, const char *stop, int32_t *out) {
    int negative = *p == '-';
    if (negative) p++;
    if (stop - p > 10) return NJ_ERROR;
    int64_t value = 0;
    for (; p < stop; p++) value = value * 10 + (*p - '0');
    if (negative) value = -value;
    if (value < INT32_MIN || value > INT32_MAX) return NJ_ERROR;
    *out = (int32_t)value;
    return 0;
}

/* Reads text[0:size], a JSON array of arrays of numbers, and returns the number of inner arrays (their
 * lengths in `lengths`), NJ_ERROR when the text is anything else, or NJ_FULL when a buffer is too small.
 * *value_count gets the number of numbers. With `integers`, they go to `values` (int32) and must be integers;
 * otherwise their texts go to `chars`, number i being chars[offsets[i]:offsets[i + 1]]. */
long nj_read_2d(const char *text, size_t size, int integers, int32_t *values, char *chars, int32_t *offsets,
                size_t value_capacity, int32_t *lengths, size_t length_capacity, size_t *value_count) {
    const char *p = text, *end = text + size;
    size_t count = 0, rows = 0, used = 0;
    if (!integers) offsets[0] = 0;
    p = skip_space(p, end);
    if (p >= end || *p != '[') return NJ_ERROR;
    p = skip_space(p + 1, end);
    if (p < end && *p == ']') {
        p++;
    } else {
        for (;;) {
            if (p >= end || *p != '[') return NJ_ERROR;
            if (rows == length_capacity) return NJ_FULL;
            size_t row_start = count;
            p = skip_space(p + 1, end);
            if (p < end && *p == ']') {
                p++;
            } else {
                for (;;) {
                    int is_integer;
                    const char *stop = number_end(p, end, &is_integer);
                    if (stop == NULL) return NJ_ERROR;
                    if (count == value_capacity) return NJ_FULL;
                    if (integers) {
                        if (!is_integer || parse_int32(p, stop, values + count) != 0) return NJ_ERROR;
                    } else {
                        if (is_integer && stop - p == 2 && p[0] == '-' && p[1] == '0') p++; /* "-0" reads as 0, as msgspec has it */
                        memcpy(chars + used, p, (size_t)(stop - p)); /* fits: the numbers' texts are within text */
                        used += (size_t)(stop - p);
                        if (used > INT32_MAX) return NJ_ERROR;
                        offsets[count + 1] = (int32_t)used;
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
                    return NJ_ERROR;
                }
            }
            if (count - row_start > INT32_MAX) return NJ_ERROR;
            lengths[rows++] = (int32_t)(count - row_start);
            p = skip_space(p, end);
            if (p < end && *p == ',') {
                p = skip_space(p + 1, end);
                continue;
            }
            if (p < end && *p == ']') {
                p++;
                break;
            }
            return NJ_ERROR;
        }
    }
    if (skip_space(p, end) != end) return NJ_ERROR;
    *value_count = count;
    return (long)rows;
}
