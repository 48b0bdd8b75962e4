"""DICOM privacy: whether a folder or file name may be shown (checked against the series' header:
identifying values, the study date, any date, long numbers, ``^``), the pseudonyms of folders and of
patients (HMAC-SHA256 with the salt), and the scrubbing of names from error messages. The rules are
in :mod:`lightning_modules.cohorts.importers.dicom`."""

from __future__ import annotations

import hashlib
import hmac
import re
import unicodedata
from pathlib import Path

SALT_ENVIRONMENT_VARIABLE = "BENCHX_PSEUDONYM_SALT"
# Header fields whose values must not appear in a folder name: a match refuses the folder.
IDENTIFYING_KEYWORDS = (
    "PatientID",
    "OtherPatientIDs",
    "PatientName",
    "OtherPatientNames",
    "PatientBirthName",
    "PatientMotherBirthName",
    "PatientBirthDate",
    "AccessionNumber",
)
_NAME_KEYWORDS = frozenset({"PatientName", "OtherPatientNames", "PatientBirthName", "PatientMotherBirthName"})
_ID_KEYWORDS = frozenset({"PatientID", "OtherPatientIDs", "AccessionNumber"})
# Dates of the examination: a folder name that spells one is imported under a pseudonym.
STUDY_DATE_KEYWORDS = ("StudyDate", "SeriesDate", "AcquisitionDate", "ContentDate")
# Shorter values (a PatientID "12", a name part "Al") occur inside ordinary names by chance; they
# count only as a whole word of the name.
MIN_TOKEN_LENGTH = 3
# Letters unicodedata does not decompose, and the German convention (Müller -> Mueller, Straße -> Strasse).
_TRANSLITERATION = str.maketrans(
    {"ä": "ae", "ö": "oe", "ü": "ue", "æ": "ae", "œ": "oe", "ø": "oe", "å": "aa", "đ": "d", "ð": "d",
     "ł": "l", "þ": "th", "ı": "i"}
)
_MONTHS = (
    ("january", "jan", "januar", "jaenner", "janvier", "janv"),
    ("february", "feb", "februar", "feber", "fevrier", "fevr", "fev"),
    ("march", "mar", "maerz", "marz", "mrz", "mars"),
    ("april", "apr", "avril", "avr"),
    ("may", "mai"),
    ("june", "jun", "juni", "juin"),
    ("july", "jul", "juli", "juillet", "juil"),
    ("august", "aug", "aout"),
    ("september", "sep", "sept"),
    ("october", "oct", "oktober", "okt", "octobre"),
    ("november", "nov", "novembre"),
    ("december", "dec", "dezember", "dez", "decembre"),
)
_SEPARATOR = r"[^0-9a-z]"
_ANY_MONTH = "|".join(sorted({name for names in _MONTHS for name in names}, key=len, reverse=True))
# Any date: 8 digits (YYYYMMDD, DDMMYYYY, MMDDYYYY), day, month and year with separators, or with a
# month name (14Mar1952, March 14 1952); an identifier: 6+ digits (also YYMMDD).
_DATE_PATTERNS = (
    re.compile(r"(?<!\d)(19|20)\d{2}(0[1-9]|1[0-2])(0[1-9]|[12]\d|3[01])(?!\d)"),
    re.compile(r"(?<!\d)(0[1-9]|[12]\d|3[01])(0[1-9]|1[0-2])(19|20)\d{2}(?!\d)"),
    re.compile(r"(?<!\d)(0[1-9]|1[0-2])(0[1-9]|[12]\d|3[01])(19|20)\d{2}(?!\d)"),
    re.compile(rf"(?<!\d)\d{{1,4}}{_SEPARATOR}+\d{{1,2}}{_SEPARATOR}+\d{{1,4}}(?!\d)"),
    re.compile(
        rf"(?<!\d)\d{{1,4}}(st|nd|rd|th)?{_SEPARATOR}*(?<![a-z])({_ANY_MONTH})(?![a-z]){_SEPARATOR}*\d{{2,4}}(?!\d)"
    ),
    re.compile(rf"(?<![a-z])({_ANY_MONTH})(?![a-z]){_SEPARATOR}*\d{{1,2}}(st|nd|rd|th)?{_SEPARATOR}*\d{{2,4}}(?!\d)"),
)
_IDENTIFIER_PATTERN = re.compile(r"\d{6,}")


def folder_pseudonym(relative_path: str, salt: str | None) -> str:
    """``DCM`` + 12 hex digits of HMAC-SHA256(salt, folder path below the source): a stable case id
    for a folder whose name may identify the patient."""
    key = (salt or "").encode("utf-8")
    return "DCM" + hmac.new(key, relative_path.encode("utf-8"), hashlib.sha256).hexdigest()[:12]


def transliterated(text: str) -> str:
    """Lowercase ASCII of ``text``, separators kept: ``Müller^Jürgen`` -> ``mueller^juergen``,
    ``Łukasz Øster`` -> ``lukasz oester`` (the German convention, then unicodedata's decomposition)."""
    text = unicodedata.normalize("NFC", text).casefold().translate(_TRANSLITERATION)
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).encode("ascii", "ignore").decode()


def _folded(text: str) -> str:
    # Letters and digits only, and ae/oe/ue read as a/o/u: "Mueller", "Müller" and "Muller" all
    # become "muller", whichever spelling the header or the folder uses.
    return re.sub(r"([aou])e", r"\1", re.sub(r"[^0-9a-z]", "", transliterated(text)))


def _words(text: str) -> set[str]:
    # Words split at separators and between letters and digits ("Ng2" -> "ng", "2").
    parts = re.split(r"[^0-9a-z]+|(?<=[a-z])(?=\d)|(?<=\d)(?=[a-z])", transliterated(text))
    return {_folded(word) for word in parts if word}


def looks_like_date_or_identifier(name: str) -> bool:
    """True when a name holds a date in any common spelling (``19520314``, ``14.03.1952``,
    ``14Mar1952``, ...), a run of 6+ digits (a record or accession number, ``520314``) or a DICOM
    person name separator (``^``)."""
    text = transliterated(name)
    return "^" in name or bool(_IDENTIFIER_PATTERN.search(text)) or any(p.search(text) for p in _DATE_PATTERNS)


def _date_parts(value: str) -> tuple[int, int, int] | None:
    digits = re.sub(r"\D", "", value)
    if len(digits) != 8:
        return None
    year, month, day = int(digits[:4]), int(digits[4:6]), int(digits[6:])
    return (year, month, day) if 1 <= month <= 12 and 1 <= day <= 31 else None


def date_spellings(value: str) -> re.Pattern | None:
    """A pattern for every common spelling of a DICOM date (``YYYYMMDD``) in a transliterated name:
    compact (19520314, 14031952, 03141952, 520314, 140352), with separators and optional zeros
    (1952-03-14, 14.3.1952, 3/14/52) and with a month name (14Mar1952, March 14th 1952, 1952mar14)."""
    parts = _date_parts(value)
    if parts is None:
        return None
    year, month, day = parts
    years = (f"{year:04d}", f"{year % 100:02d}")
    alternatives = []
    for y in years:
        mm, dd = f"{month:02d}", f"{day:02d}"
        alternatives += [y + mm + dd, dd + mm + y, mm + dd + y]
    y_any, m_num, d_num = rf"(?:{year // 100:02d})?{year % 100:02d}", rf"0?{month}", rf"0?{day}(?:st|nd|rd|th)?"
    m_name = rf"(?<![a-z])(?:{'|'.join(sorted(_MONTHS[month - 1], key=len, reverse=True))})(?![a-z])"
    separated = rf"{_SEPARATOR}+"
    for a, b, c in ((y_any, m_num, d_num), (d_num, m_num, y_any), (m_num, d_num, y_any)):
        alternatives.append(separated.join((a, b, c)))
    loose = rf"{_SEPARATOR}*"
    for a, b, c in ((d_num, m_name, y_any), (m_name, d_num, y_any), (y_any, m_name, d_num)):
        alternatives.append(loose.join((a, b, c)))
    return re.compile("|".join(rf"(?<!\d)(?:{alternative})(?!\d)" for alternative in alternatives))


def _values(header, keyword: str) -> list[str]:
    from pydicom.multival import MultiValue

    value = header.get(keyword) if header is not None else None
    if value is None:
        return []
    # A multi-valued element (OtherPatientIDs "A\\B") is a MultiValue; a PersonName iterates characters.
    values = [str(v) for v in value] if isinstance(value, (MultiValue, list, tuple)) else [str(value)]
    return [v for v in values if v.strip()]


def identifying_fields_in(name: str, header) -> list[str]:
    """The keywords of :data:`IDENTIFYING_KEYWORDS` whose value occurs in ``name``.

    Names are compared transliterated (``Mueller_Juergen`` matches ``Müller^Jürgen``), case- and
    separator-insensitive, part by part; ids also without leading zeros; the birth date in every
    spelling of :func:`date_spellings`. Values never leave this function.
    """
    folded, words, text = _folded(name), _words(name), transliterated(name)
    found = []
    for keyword in IDENTIFYING_KEYWORDS:
        for value in _values(header, keyword):
            if keyword == "PatientBirthDate":
                pattern = date_spellings(value)
                hit = pattern is not None and bool(pattern.search(text))
            else:
                if keyword in _NAME_KEYWORDS:
                    tokens = {_folded(t) for t in re.split(r"[\^=\s,\-]+", value)} | {_folded(value)}
                else:
                    tokens = {_folded(value), _folded(value).lstrip("0")}
                tokens.discard("")
                hit = any(t in folded if len(t) >= MIN_TOKEN_LENGTH else t in words for t in tokens)
            if hit:
                found.append(keyword)
                break
    return found


def study_date_in(name: str, header) -> bool:
    """True when ``name`` spells one of the series' examination dates (:data:`STUDY_DATE_KEYWORDS`)."""
    text = transliterated(name)
    patterns = (date_spellings(value) for keyword in STUDY_DATE_KEYWORDS for value in _values(header, keyword))
    return any(pattern is not None and pattern.search(text) for pattern in patterns)


def name_is_harmless(name: str, header) -> bool:
    """A folder or file name may be shown only when the series' header could be read and the name
    holds none of its identifying values or dates, no date in any spelling, no long number and no
    person-name separator. In doubt, it is not harmless (and is pseudonymized)."""
    return (
        header is not None
        and not identifying_fields_in(name, header)
        and not study_date_in(name, header)
        and not looks_like_date_or_identifier(name)
    )


def pseudonymous_patient_id(patient_id: str, salt: str) -> str:
    """``P`` + 16 hex digits of HMAC-SHA256(salt, PatientID): stable per salt, not reversible without it."""
    digest = hmac.new(salt.encode("utf-8"), patient_id.strip().encode("utf-8"), hashlib.sha256).hexdigest()
    return "P" + digest[:16]


def _without_names(text: str, names: list[tuple[Path, str]], folder: Path, shown_folder: str) -> str:
    """``text`` with each file's path, name and stem replaced by what errors show for it, and the
    folder's path by ``shown_folder`` (one pass, longest first, so no replacement is replaced again)."""
    replacements = {str(folder): shown_folder}
    for path, shown in names:
        replacements[str(path)] = shown
        replacements.update({part: shown for part in (path.name, path.stem) if len(part) >= MIN_TOKEN_LENGTH})
    pattern = re.compile("|".join(re.escape(key) for key in sorted(replacements, key=len, reverse=True)))
    return pattern.sub(lambda match: replacements[match.group(0)], text)
