//! UCX's own log on stderr, never on stdout.
//!
//! UCX writes its log (warnings such as `connect(...) failed: No route to host` while a link
//! is down) to the process's stdout unless `UCX_LOG_FILE` says otherwise, and a process whose
//! stdout carries data (`reshard receive --json`: one JSON object per line) is then broken by
//! it. Setting `UCX_LOG_FILE` from inside a running process is not an option: libucs reads
//! it once, in its constructor, and changing the environment of a process whose other threads
//! may read it is unsound. UCX's public log API instead lets a program add a log handler
//! (`ucs_log_push_handler`, <ucs/debug/log_def.h>), which runs before UCX's default one: this
//! module's handler formats each message and writes it to stderr, and stops UCX's handler
//! from printing it again. Messages reach it only at the levels `UCX_LOG_LEVEL` enables, as
//! before; fatal ones are left to UCX (it prints them to stderr and aborts).
//!
//! A user who set `UCX_LOG_FILE` keeps UCX's own behaviour. The handler is added only to a
//! libucs this process loaded itself just now (no other thread can be logging through it
//! while the handler list changes); a libucs someone else loaded first is left alone. The
//! ucx backend calls this for the system's libucs, the nixl backend for the copy of UCX its
//! runtime bundles.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, OsStr};
use std::os::fd::BorrowedFd;

/// `UCS_LOG_LEVEL_*` names, indexed by level (<ucs/config/types.h>).
const LEVELS: [&str; 12] = [
    "FATAL", "ERROR", "WARN", "DIAG", "INFO", "DEBUG", "TRACE", "REQ", "DATA", "ASYNC", "FUNC",
    "POLL",
];
/// `UCS_LOG_LEVEL_FATAL`: left to UCX's own handler.
const FATAL: c_int = 0;
/// `ucs_log_func_rc_t`: `UCS_LOG_FUNC_RC_STOP`, `UCS_LOG_FUNC_RC_CONTINUE`.
const RC_STOP: c_int = 0;
const RC_CONTINUE: c_int = 1;
/// Bytes of one formatted message (UCX's own default, `UCX_LOG_BUFFER`, is 1024).
const BUFFER: usize = 1024;

/// `ucs_log_func_t`. The `va_list` argument is passed on to `vsnprintf` untouched: on x86-64
/// it is an array type, which C passes as a pointer to its first element, and on AArch64 a
/// structure larger than 16 bytes, which the procedure call standard passes as a pointer to
/// the caller's copy; either way a pointer, forwarded as it came.
type Handler = unsafe extern "C" fn(
    file: *const c_char,
    line: c_uint,
    function: *const c_char,
    level: c_int,
    comp_conf: *const c_void,
    message: *const c_char,
    ap: *mut c_void,
) -> c_int;

/// `void ucs_log_push_handler(ucs_log_func_t handler)`.
type PushHandler = unsafe extern "C" fn(handler: Handler);

unsafe extern "C" {
    /// C's `vsnprintf`, taking the `va_list` as the pointer it is passed as (see [`Handler`]).
    fn vsnprintf(s: *mut c_char, n: usize, format: *const c_char, ap: *mut c_void) -> c_int;
}

/// Whether the user chose where UCX logs (`UCX_LOG_FILE` set and not empty): then UCX's own
/// behaviour is kept.
pub fn user_chose_log_file() -> bool {
    std::env::var_os("UCX_LOG_FILE").is_some_and(|v| !v.is_empty())
}

/// Whether a shared library of this file name (a soname or a path) is loaded in the process.
pub fn is_loaded(name: &OsStr) -> bool {
    // SAFETY: RTLD_NOLOAD never loads anything, so no initialiser runs; the reference taken
    // on an already loaded library is dropped again at once.
    unsafe { libloading::os::unix::Library::open(Some(name), libc::RTLD_NOLOAD | libc::RTLD_LAZY) }
        .is_ok()
}

/// Makes the libucs `ucs` write UCX's log to stderr (see the module docs); returns whether the
/// handler was added. Call it only right after this process loaded that libucs for the first
/// time (check [`is_loaded`] before loading it), before any UCX object of it exists, and not
/// when [`user_chose_log_file`].
pub fn log_to_stderr(ucs: &libloading::Library) -> bool {
    if !cfg!(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    )) {
        // The va_list forwarding above is checked for these only.
        return false;
    }
    // SAFETY: `ucs_log_push_handler` has this C signature in every UCX release that has it
    // (1.9 on); the handler is a plain function that lives for the whole process. No other
    // thread logs through this libucs yet (the caller's contract), so the handler list is not
    // read while it changes.
    unsafe {
        match ucs.get::<PushHandler>(b"ucs_log_push_handler\0") {
            Ok(push) => {
                push(handler);
                true
            }
            Err(_) => false,
        }
    }
}

/// Formats one UCX log message and writes it to stderr as one line (one `write`):
/// `[ucx <LEVEL> <pid>] <file>:<line> <message>`.
unsafe extern "C" fn handler(
    file: *const c_char,
    line: c_uint,
    _function: *const c_char,
    level: c_int,
    _comp_conf: *const c_void,
    message: *const c_char,
    ap: *mut c_void,
) -> c_int {
    if level <= FATAL || message.is_null() {
        return RC_CONTINUE;
    }
    let mut text = [0 as c_char; BUFFER];
    // SAFETY: `message` and `ap` are the format and arguments UCX's dispatcher passes (it
    // starts `ap` for each handler); `text` has room for BUFFER bytes and vsnprintf writes at
    // most that many, NUL included.
    unsafe { vsnprintf(text.as_mut_ptr(), BUFFER, message, ap) };
    text[BUFFER - 1] = 0;
    // SAFETY: NUL-terminated just above (or by vsnprintf).
    let text = unsafe { CStr::from_ptr(text.as_ptr()) }.to_string_lossy();
    let file = if file.is_null() {
        std::borrow::Cow::Borrowed("?")
    } else {
        // SAFETY: UCX passes `__FILE__`, a static NUL-terminated string.
        unsafe { CStr::from_ptr(file) }.to_string_lossy()
    };
    let file = file.rsplit('/').next().unwrap_or_default();
    let name = usize::try_from(level)
        .ok()
        .and_then(|l| LEVELS.get(l))
        .copied()
        .unwrap_or("LOG");
    let out = format!(
        "[ucx {name} {}] {file}:{line} {}\n",
        std::process::id(),
        text.trim_end()
    );
    // SAFETY: fd 2 is the process's stderr, open for its whole life (a closed one makes the
    // write fail, which is ignored: a log line is not worth a crash).
    let stderr = unsafe { BorrowedFd::borrow_raw(2) };
    let _ = rustix::io::write(stderr, out.as_bytes());
    RC_STOP
}
