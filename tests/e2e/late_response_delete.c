/* Preloaded into tritonserver by tests/e2e/test_clean_stop.py (LD_PRELOAD): holds back the deletion of every
 * inference response by DSV4_LATE_DELETE_MS milliseconds, and reports a response that is deleted after a frontend's
 * response allocator was (tritonserver's stop deletes the HTTP frontend, and with it its allocator, before it stops
 * the models).
 *
 * tritonserver's HTTP generate endpoints end a client's reply on a FINAL response before deleting that response. A
 * FINAL with outputs deleted after the HTTP frontend is gone releases them through a freed allocator: the server
 * crashed at its stop when a Ctrl-C came right after an answer, when the freed memory had been reused. Held back,
 * every such deletion lands after the stop's and is reported here, instead of crashing now and then.
 *
 * Valid for HTTP traffic that ended before the stop: responses to requests still running at the stop may be deleted
 * later legitimately (by the gRPC frontend, whose allocators go last). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

typedef void *(*delete_fn)(void *);

static atomic_int allocator_deleted;

static delete_fn next_symbol(const char *name) { return (delete_fn)dlsym(RTLD_NEXT, name); }

/* In tritonserver's log: the shim is in the process the test watches (and in the stub's, where it does nothing). */
__attribute__((constructor)) static void loaded(void) {
  static const char marker[] = "[late_response_delete] loaded\n";
  write(2, marker, sizeof marker - 1);
}

void *TRITONSERVER_ResponseAllocatorDelete(void *allocator) {
  atomic_store(&allocator_deleted, 1);
  return next_symbol("TRITONSERVER_ResponseAllocatorDelete")(allocator);
}

void *TRITONSERVER_InferenceResponseDelete(void *response) {
  if (response != NULL) {
    const char *delay_ms = getenv("DSV4_LATE_DELETE_MS");
    usleep((useconds_t)(delay_ms ? atoi(delay_ms) : 300) * 1000);
    if (atomic_load(&allocator_deleted)) {
      static const char marker[] = "[late_response_delete] a response deleted after its frontend's allocator\n";
      write(2, marker, sizeof marker - 1);
      return NULL; /* (not deleted: its outputs would be released through the freed allocator) */
    }
  }
  return next_symbol("TRITONSERVER_InferenceResponseDelete")(response);
}
