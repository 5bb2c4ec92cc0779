/* test_plain_pickle.c — vram_plain_pickle_check over hand-written opcode streams: plain data
 * passes; every way to name an object, every length past the data and every memo index past
 * those stored is refused with the opcode's offset; the walk never reads past the buffer (the
 * sanitizer builds of this test check that: each case is copied into a buffer of its exact
 * length). The Python tests check the same function against pickles Python itself writes. */
#include <stdlib.h>

#include "harness.h"

/* The check of `n` bytes, in a heap buffer of exactly that size so ASan sees any overread. */
static vram_status_t check(const char *bytes, size_t n, int *names_code) {
    char *copy = malloc(n ? n : 1);
    memcpy(copy, bytes, n);
    vram_status_t s = vram_plain_pickle_check(copy, n, names_code);
    free(copy);
    return s;
}

#define CASE(lit) (lit), (sizeof(lit) - 1)

/* pickle.dumps({'a': [1, 2.5, None, True, 'xy', b'z']}, protocol=4), as Python writes it: a
 * frame, memo entries, most plain opcodes. */
static const char P4[] = "\x80\x04\x95\x22\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01" "a\x94]\x94(K\x01G@\x04\x00"
                         "\x00\x00\x00\x00\x00N\x88\x8c\x02xy\x94" "C\x01z\x94" "es.";

static void test_plain_data_passes(void) {
    int code = -1;
    CHECK_OK(check(CASE(P4), &code));
    CHECK(code == 0);
    /* protocol 0: (lp0\nI1\naS'x'\np1\na. with PUT/GET */
    CHECK_OK(check(CASE("(lp0\nI1\naS'x'\np1\nag1\na."), &code));
    /* bytes after STOP are not read by the unpickler, so not by the check either */
    CHECK_OK(check(CASE("N.\xff\xff"), &code));
}

static void test_objects_are_refused(void) {
    int code = 0;
    CHECK_STATUS(check(CASE("\x80\x04\x8c\x05posix\x94\x8c\x06system\x94\x93\x94."), &code), VRAM_ERR_INVALID_ARG);
    CHECK(code == 1);
    CHECK_CONTAINS(vram_last_error(), "a class reference (posix.system)");
    code = 0;
    CHECK_STATUS(check(CASE("cos\nsystem\n(S'ls'\ntR."), &code), VRAM_ERR_INVALID_ARG);
    CHECK(code == 1);
    CHECK_CONTAINS(vram_last_error(), "(os.system)");
    static const char *calls[] = {"\x80\x02}R.", "\x80\x02}b.", "\x80\x02(o.", "\x80\x02)}\x81.", "\x80\x02Q.",
                                  "\x80\x05\x97.", "\x80\x02\x82\x01.", "P1\n."};
    for (size_t i = 0; i < sizeof calls / sizeof *calls; i++) {
        code = 0;
        CHECK_STATUS(check(calls[i], strlen(calls[i]), &code), VRAM_ERR_INVALID_ARG);
        CHECK(code == 1);
    }
}

static void test_lengths_and_indexes_past_the_data_are_refused(void) {
    int code = 1;
    CHECK_STATUS(check(CASE("\x80\x04\x8e\x00\x00\x00\x00\x00\x00\x00\x40" "abc."), &code), VRAM_ERR_INVALID_ARG);
    CHECK(code == 0);
    CHECK_CONTAINS(vram_last_error(), "BINBYTES8 at byte 2 declares a length past the end");
    CHECK_STATUS(check(CASE("\x80\x02Nr\x00\x00\x00\x80."), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "LONG_BINPUT at byte 3 stores memo entry far past");
    CHECK_STATUS(check(CASE("\x80\x02Nq\x00q\x01h\x02."), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "BINGET at byte 7 reads a memo entry never stored");
    CHECK_STATUS(check(CASE("(lp99999999999999999999999\n."), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "PUT at byte 2 has a bad index");
    CHECK_STATUS(check(CASE("\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xff" "N."), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "FRAME at byte 2 is longer than the data left");
    CHECK_STATUS(check(CASE("\x80\x02T\xff\xff\xff\xff."), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "BINSTRING at byte 2 has a negative length");
    CHECK_STATUS(check(CASE("\x80\x02I12"), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "has no newline");
    CHECK_STATUS(check(CASE("\x80\x02J\x01\x02"), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "needs more bytes than the data has left");
    CHECK_STATUS(check(CASE("\x80\x02N"), &code), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "without a STOP opcode");
    CHECK_STATUS(check("", 0, &code), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_plain_pickle_check(NULL, 4, NULL), VRAM_ERR_INVALID_ARG);
}

/* Every prefix of a valid pickle is refused cleanly (no overread: the buffer is exact). */
static void test_every_truncation_is_refused(void) {
    for (size_t n = 0; n + 1 < sizeof P4 - 1; n++) CHECK_STATUS(check(P4, n, NULL), VRAM_ERR_INVALID_ARG);
}

int main(void) {
    RUN(test_plain_data_passes);
    RUN(test_objects_are_refused);
    RUN(test_lengths_and_indexes_past_the_data_are_refused);
    RUN(test_every_truncation_is_refused);
    return harness_finish();
}
