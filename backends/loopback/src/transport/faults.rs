//! Test-only fault injection for the copy jobs ([`Faults`]).

/// Test-only fault injection for the copy jobs.
#[cfg(test)]
#[derive(Default, Clone)]
pub(crate) struct Faults {
    /// Panic when a job reaches this piece index.
    pub(crate) panic_at_piece: Option<usize>,
    /// Sleep this long before each piece (makes abort observable).
    pub(crate) piece_delay: Option<std::time::Duration>,
}

#[cfg(test)]
impl Faults {
    pub(crate) fn before_piece(&self, k: usize) {
        if let Some(d) = self.piece_delay {
            std::thread::sleep(d);
        }
        if self.panic_at_piece == Some(k) {
            panic!("injected fault at piece {k}");
        }
    }
}
