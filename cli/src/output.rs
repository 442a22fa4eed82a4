//! Standard output for every command: a reader that closes the pipe early (`reshard plan |
//! head`) ends the process quietly with status 141, what a shell reports for a process killed
//! by SIGPIPE, instead of the panic `println!` raises on a broken pipe. Any other write error
//! (a full disk behind a redirection) is reported on stderr with status 1.

use std::fmt;
use std::io::{ErrorKind, Write};

/// The exit status of a command whose standard output was closed under it (128 + SIGPIPE).
pub(crate) const BROKEN_PIPE_STATUS: i32 = 141;

/// Writes `args` (and a newline if `newline`) to standard output, or ends the process as the
/// module docs say.
pub(crate) fn write(args: fmt::Arguments<'_>, newline: bool) {
    let mut out = std::io::stdout().lock();
    let r = out
        .write_fmt(args)
        .and_then(|()| {
            if newline {
                out.write_all(b"\n")
            } else {
                Ok(())
            }
        })
        .and_then(|()| if newline { Ok(()) } else { out.flush() });
    if let Err(e) = r {
        if e.kind() == ErrorKind::BrokenPipe {
            std::process::exit(BROKEN_PIPE_STATUS);
        }
        eprintln!("reshard: cannot write to standard output: {e}");
        std::process::exit(1);
    }
}

/// `println!` for command output (see [`write`]).
macro_rules! outln {
    () => {
        $crate::output::write(format_args!(""), true)
    };
    ($($arg:tt)*) => {
        $crate::output::write(format_args!($($arg)*), true)
    };
}

/// `print!` for command output (see [`write`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write(format_args!($($arg)*), false)
    };
}
