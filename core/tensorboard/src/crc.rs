//! CRC32C (Castagnoli) and the masked form TFRecord framing stores.

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

/// The constant TFRecord adds to the rotated CRC.
const MASK_DELTA: u32 = 0xa282_ead8;

/// Byte-at-a-time lookup table, built at compile time.
const TABLE: [u32; 256] = build_table();

const fn build_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            bit += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

/// CRC32C of `data` (initial value and final xor `0xFFFF_FFFF`, as in iSCSI and TFRecord).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc = TABLE[((crc ^ u32::from(byte)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The masked CRC32C TFRecord stores: the CRC rotated right by 15 bits plus `0xa282ead8`
/// (wrapping), so that a CRC of data that itself holds CRCs is not trivially related to them.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    mask(crc32c(data))
}

/// Masks an already computed CRC32C (see [`masked_crc32c`]).
pub fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_vector() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    #[allow(clippy::manual_rotate)] // spelled out as TFRecord defines it, against `rotate_right`
    fn masked_crc_matches_definition_and_tensorboard() {
        let crc = crc32c(b"123456789");
        assert_eq!(masked_crc32c(b"123456789"), ((crc >> 15) | (crc << 17)).wrapping_add(0xa282ead8));
        // Values printed by tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c.
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
        assert_eq!(masked_crc32c(&[0u8; 8]), 0x0798_0329);
    }
}
