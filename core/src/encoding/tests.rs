//! The byte reader, the varints and the truncated-table refusal of the encoding.

use super::*;

#[test]
fn byte_reader_reads_little_endian_and_reports_truncation() {
    let b = [1u8, 2, 0, 3, 0, 0, 0, 9];
    let mut r = ByteReader::new(&b);
    assert_eq!(r.u8(), Ok(1));
    assert_eq!(r.u16(), Ok(2));
    assert_eq!(r.u32(), Ok(3));
    assert_eq!(r.at(), 7);
    assert_eq!(r.u64(), Err(Truncated { at: 7, needed: 7 }));
    assert_eq!(r.ensure(2), Err(Truncated { at: 7, needed: 1 }));
    assert_eq!(r.take(1), Ok(&[9u8][..]));
    assert_eq!(r.left(), 0);
}

#[test]
fn a_short_table_names_the_field_and_what_it_needed() {
    let e = decode_table(b"RS").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Decode);
    let msg = e.to_string();
    assert!(
        msg.contains("truncated: magic needs 4 bytes, 2 remain (in the header, at byte 0)"),
        "{msg}"
    );
}

fn read_varint(bytes: &[u8]) -> Result<u64> {
    let mut r = Reader::new(bytes);
    let v = r.varint("v")?;
    assert_eq!(
        r.pos(),
        bytes.len(),
        "varint must consume all of {bytes:02x?}"
    );
    Ok(v)
}

#[test]
fn varint_round_trips_at_the_edges() {
    for v in [
        0,
        1,
        127,
        128,
        255,
        16_383,
        16_384,
        u32::MAX as u64,
        u64::MAX - 1,
        u64::MAX,
    ] {
        let mut w = Vec::new();
        put_varint(&mut w, v);
        assert!(w.len() <= 10);
        assert_eq!(read_varint(&w).unwrap(), v);
    }
}

#[test]
fn varint_rejects_overflow_non_minimal_and_truncation() {
    let mut too_big = vec![0xff; 9];
    too_big.push(0x02);
    let eleven = vec![0x80; 11];
    for bad in [too_big, eleven, vec![0x80, 0x00], vec![0x80], vec![]] {
        let e = read_varint(&bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode, "{bad:02x?}");
    }
}
