"""The reader's parse-tree allowlist (``sinks.sqlguard.refusal``) over ``EXPLAIN AST``
texts as the embedded engine (chdb 4.4, ClickHouse 26.9) prints them."""

from __future__ import annotations

import pytest

from probewire.sinks.sqlguard import refusal

SELECT_TABLE = """SelectWithUnionQuery (children 2)
 ExpressionList (children 1)
  SelectQuery (children 2)
   ExpressionList (children 1)
    Identifier x
   TablesInSelectQuery (children 1)
    TablesInSelectQueryElement (children 1)
     TableExpression (children 1)
      TableIdentifier probewire.runs (alias r)
 Identifier JSON
"""
SELECT_NUMBERS_SETTINGS = """SelectWithUnionQuery (children 1)
 ExpressionList (children 1)
  SelectQuery (children 3)
   ExpressionList (children 1)
    Function count (children 1)
     ExpressionList
   TablesInSelectQuery (children 1)
    TablesInSelectQueryElement (children 1)
     TableExpression (children 1)
      Function numbers (children 1)
       ExpressionList (children 1)
        Literal UInt64_3
   Set
"""
FILE_IN_SUBQUERY = """SelectWithUnionQuery (children 1)
 ExpressionList (children 1)
  SelectQuery (children 2)
   ExpressionList (children 1)
    Asterisk
   TablesInSelectQuery (children 1)
    TablesInSelectQueryElement (children 1)
     TableExpression (children 1)
      Subquery (children 1)
       SelectWithUnionQuery (children 1)
        ExpressionList (children 1)
         SelectQuery (children 2)
          ExpressionList (children 1)
           Asterisk
          TablesInSelectQuery (children 1)
           TablesInSelectQueryElement (children 1)
            TableExpression (children 1)
             Function url (alias t) (children 1)
              ExpressionList (children 1)
               Literal 'http://127.0.0.1:1/'
"""
SCALAR_FILE = """SelectWithUnionQuery (children 1)
 ExpressionList (children 1)
  SelectQuery (children 1)
   ExpressionList (children 1)
    Function FILE (children 1)
     ExpressionList (children 1)
      Literal '/proc/self/environ'
"""
OUTFILE = """SelectWithUnionQuery (children 3)
 ExpressionList (children 1)
  SelectQuery (children 1)
   ExpressionList (children 1)
    Literal UInt64_1
 Literal '/tmp/out.txt'
 Identifier CSV
"""
STRING_LITERAL_SELECT = """SelectWithUnionQuery (children 1)
 ExpressionList (children 1)
  SelectQuery (children 1)
   ExpressionList (children 1)
    Literal 'file'
"""


@pytest.mark.parametrize(
    "ast",
    [SELECT_TABLE, SELECT_NUMBERS_SETTINGS, STRING_LITERAL_SELECT, "ShowTables\n"],
    ids=["table-format", "numbers-settings", "literal", "show"],
)
def test_reads_pass(ast: str) -> None:
    """SELECTs over tables, arithmetic table functions, SETTINGS / FORMAT clauses and SHOW
    are answered."""
    assert refusal(ast) is None


@pytest.mark.parametrize(
    ("ast", "needle"),
    [
        (FILE_IN_SUBQUERY, "table function url()"),
        (SCALAR_FILE, "function file()"),
        (OUTFILE, "INTO OUTFILE"),
        ("KillQueryQuery  (children 1)\n Function equals\n", "KillQueryQuery"),
        ("SYSTEM query\n", "SYSTEM"),
        ("InsertQuery   (children 2)\n Function file (children 1)\n", "InsertQuery"),
        ("", "empty"),
    ],
    ids=["url-in-subquery", "scalar-file", "outfile", "kill", "system", "insert-function", "empty"],
)
def test_host_and_write_statements_are_refused(ast: str, needle: str) -> None:
    """A table function reaching out (however deep), scalar file(), INTO OUTFILE, KILL,
    SYSTEM and INSERT INTO FUNCTION each get a refusal naming what was refused."""
    reason = refusal(ast)
    assert reason is not None and needle in reason
