//! Test-only fault injection for the copy jobs ([`Faults`]).

/// Test-only fault injection for the copy jobs.
#[cfg(test)]
#[derive(Default, Clone)]
pub(crate) struct Faults {
    /// Panic when a job reaches this piece index.
    pub(crate) panic_at_piece: Option<usize>,
    /// Sleep this long before each piece (makes abort observable).
    pub(crate) piece_delay: Option<std::time::Duration>,
    /// Sleep this long before the first piece of this read (one worker held up).
    pub(crate) stall_read: Option<(u32, std::time::Duration)>,
    /// Panic at the first piece of this read (one list fails, the others do not).
    pub(crate) panic_read: Option<u32>,
}

#[cfg(test)]
impl Faults {
    pub(crate) fn before_piece(&self, k: usize, read: u32, off: u64) {
        if let Some((r, d)) = self.stall_read {
            if r == read && off == 0 {
                std::thread::sleep(d);
            }
        }
        if let Some(d) = self.piece_delay {
            std::thread::sleep(d);
        }
        if self.panic_read == Some(read) && off == 0 {
            panic!("injected fault at read {read}");
        }
        if self.panic_at_piece == Some(k) {
            panic!("injected fault at piece {k}");
        }
    }
}
